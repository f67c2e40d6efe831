"""The memory plot stays readable at any world size: ranks are summarized per pipeline stage."""

from __future__ import annotations

import pytest

from orch.tracking.report import measured_by_stage, memory_figure

PREDICTED = {"params": 10.0, "grads": 10.0, "optimizer_states": 20.0, "activations": 5.0, "buffers": 1.0,
             "reserve": 2.0}


def test_ranks_are_grouped_by_their_pipeline_stage_as_placed():
    # tp=2, pp=2: ranks 0,1 stage 0; 2,3 stage 1; 4,5 stage 0; 6,7 stage 1.
    peaks = {r: float(100 + r) for r in range(8)}
    stages = measured_by_stage(peaks, tp=2, pp=2)
    assert [(s.stage, s.ranks, s.low, s.high) for s in stages] == [(0, 4, 100.0, 105.0), (1, 4, 102.0, 107.0)]
    assert stages[0].median == pytest.approx((101 + 104) / 2)


@pytest.mark.parametrize("ranks,pp", [(2, 1), (8, 2), (64, 4)])
def test_the_memory_plot_has_one_bar_per_stage_and_its_legend_outside(ranks, pp, tmp_path):
    stages = measured_by_stage({r: 40.0 + r % 5 for r in range(ranks)}, tp=1, pp=pp)
    fig = memory_figure(PREDICTED, stages)
    fig.savefig(tmp_path / "memory.png", bbox_inches="tight")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert len(labels) == 1 + pp
    assert sum(f"({ranks // pp} rank" in label for label in labels) == pp

    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels()]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), labels
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.x0 >= ax.get_window_extent(renderer).x1, "the legend must not cover the bars"
    assert (tmp_path / "memory.png").stat().st_size > 0
