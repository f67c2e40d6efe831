"""Pictures and summaries of tracked runs: `orch report RUN_ID`, `orch runs`, and the plots
every `orch train` logs to its MLflow run when it ends.

Everything is read back from MLflow, so a report looks the same whether it is made at the end
of training or weeks later from another machine.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on training nodes or CI
import matplotlib.pyplot as plt  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from orch.plans.engines import EngineSpec, engine_names, engine_spec  # noqa: E402
from orch.tracking.goodput import LOSSES  # noqa: E402
from orch.tracking.step_prediction import (  # noqa: E402
    PhaseComparison,
    most_wrong,
    phase_comparisons,
    step_time_lines,
)
from orch.tracking.store import open_existing, reading  # noqa: E402

MIB = 1024**2
_COMPONENTS = ("params", "grads", "optimizer_states", "activations", "buffers", "reserve")


def _history(client: MlflowClient, run_id: str, key: str) -> tuple[list[int], list[float]]:
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
    return [m.step for m in points], [m.value for m in points]


def write_plots(client: MlflowClient, run_id: str, out_dir: Path) -> list[Path]:
    """loss.png, throughput.png, memory.png, and system.png, step_time.png and ranks.png (the ranks'
    phases where they differed) when the run measured them; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    run = client.get_run(run_id)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("loss", "eval_loss"):
        steps, values = _history(client, run_id, key)
        if steps:
            ax.plot(steps, values, marker="o" if key == "eval_loss" else None, label=key)
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title=f"loss: {run.info.run_name}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    written.append(_save(fig, out_dir / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, values = _history(client, run_id, "tokens_per_s")
    ax.plot(steps, values, color="tab:green", label="tokens/s")
    ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    mfu_steps, mfu = _history(client, run_id, "mfu")
    if mfu_steps:
        twin = ax.twinx()
        twin.plot(mfu_steps, [100 * v for v in mfu], color="tab:orange", label="MFU %")
        twin.set_ylabel("MFU (% of measured matmul peak)")
    written.append(_save(fig, out_dir / "throughput.png"))

    params = run.data.params
    predicted = {c: int(params.get(f"memory.predicted.{c}", 0)) / MIB for c in _COMPONENTS}
    measured = {int(key.split("/")[1].removeprefix("rank")): value / MIB for key, value in run.data.metrics.items()
                if key.startswith("memory/rank") and key.endswith("/measured_peak_bytes")}
    stages = measured_by_stage(measured, tp=int(params.get("plan.tp", 1)), pp=int(params.get("plan.pp", 1)))
    fig = memory_figure(predicted, stages)
    written.append(_save(fig, out_dir / "memory.png"))
    if any(key.startswith("system/") for key in run.data.metrics):
        written.append(_save(system_figure(client, run), out_dir / "system.png"))
    if comparisons := phase_comparisons(client, run_id, params, run.data.metrics):
        written.append(_save(step_time_figure(comparisons), out_dir / "step_time.png"))
    if (ranks := rank_phase_figure(client, run)) is not None:
        written.append(_save(ranks, out_dir / "ranks.png"))
    return written


def step_time_figure(comparisons: list[PhaseComparison]):
    """Predicted and measured seconds per step, phase by phase, side by side."""
    fig, ax = plt.subplots(figsize=(7, 4))
    positions = range(len(comparisons))
    ax.bar([i - 0.2 for i in positions], [c.predicted_s for c in comparisons], width=0.4, label="predicted")
    ax.bar([i + 0.2 for i in positions], [c.measured_s for c in comparisons], width=0.4, label="measured",
           color="tab:gray")
    ax.set_xticks(list(positions), [c.name for c in comparisons])
    worst = most_wrong(comparisons)
    ax.set(ylabel="seconds per step", title=f"step time by phase (most wrong: {worst.name})")
    ax.legend()
    return fig


def rank_phase_figure(client: MlflowClient, run):
    """Ranks x logged steps: how far each rank's slowest phase ran past the ranks' median there, in
    ms, from the per-rank phases a run tracks where its ranks differ (:mod:`orch.tracking.stragglers`);
    None when it tracked none."""
    import re

    found: dict[int, dict[str, dict[int, float]]] = {}
    for key in run.data.metrics:
        if match := re.fullmatch(r"step_phase/rank(\d+)/(\w+)_s", key):
            rank, phase = int(match[1]), match[2]
            steps, values = _history(client, run.info.run_id, key)
            found.setdefault(rank, {})[phase] = dict(zip(steps, values, strict=True))
    if not found:
        return None
    ranks = sorted(found)
    steps = sorted({step for phases in found.values() for history in phases.values() for step in history})
    phases = sorted({phase for by_phase in found.values() for phase in by_phase})
    grid = []
    for rank in ranks:
        row = []
        for step in steps:
            excess = []
            for phase in phases:
                times = [found[r].get(phase, {}).get(step) for r in ranks]
                times = [t for t in times if t is not None]
                mine = found[rank].get(phase, {}).get(step)
                if mine is not None and times:
                    excess.append(mine - statistics.median(times))
            row.append(1e3 * max(excess) if excess else float("nan"))
        grid.append(row)
    fig, ax = plt.subplots(figsize=(7, 1.5 + 0.35 * len(ranks)))
    image = ax.imshow(grid, aspect="auto", cmap="Reds", interpolation="nearest")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xticks(range(len(steps)), [str(s) for s in steps])
    ax.set(xlabel="step", title="ms per step past the ranks' median, in each rank's slowest phase")
    fig.colorbar(image, ax=ax)
    return fig


# The system metrics drawn, as MLflow names them, with their axis labels.
_SYSTEM_PLOTS = (("cpu_utilization_percentage", "CPU %"), ("system_memory_usage_percentage", "memory %"),
                 ("gpu_utilization_percentage", "GPU %"), ("gpu_memory_usage_percentage", "GPU memory %"))


def system_figure(client: MlflowClient, run):
    """Each node's hardware use over the run, one line per node (``system/node<i>/...``)."""
    nodes = sorted({key.split("/")[1] for key in run.data.metrics if key.startswith("system/")})
    shown = [(name, label) for name, label in _SYSTEM_PLOTS
             if any(f"system/{node}/{name}" in run.data.metrics for node in nodes)]
    fig, axes = plt.subplots(len(shown), 1, figsize=(7, 2.2 * len(shown)), sharex=True, squeeze=False)
    for ax, (name, label) in zip(axes[:, 0], shown, strict=True):
        for node in nodes:
            steps, values = _history(client, run.info.run_id, f"system/{node}/{name}")
            host = run.data.tags.get(f"system.{node}", "")
            ax.plot(steps, values, label=f"{node} {host}".strip())
        ax.set(ylabel=label, ylim=(0, 100))
    axes[0, 0].set_title("hardware use per node")
    axes[-1, 0].set_xlabel("sample (every tracking.system_metrics_interval_s)")
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return fig


@dataclass(frozen=True)
class StagePeaks:
    """The measured peaks of one pipeline stage's ranks, summarized: one bar whatever the rank count."""

    stage: int
    ranks: int
    low: float
    median: float
    high: float


def measured_by_stage(peaks_by_rank: dict[int, float], *, tp: int, pp: int) -> list[StagePeaks]:
    """Min, median and max of the ranks' measured peaks per pipeline stage.

    A rank's stage follows from the placement (orch/launchers/placement.py):
    ``rank = (dp_rank * pp + pp_rank) * tp + tp_rank``, so ``pp_rank = (rank // tp) % pp``.
    """
    grouped: dict[int, list[float]] = {}
    for rank, peak in peaks_by_rank.items():
        grouped.setdefault((rank // max(tp, 1)) % max(pp, 1), []).append(peak)
    return [StagePeaks(stage, len(values), min(values), statistics.median(values), max(values))
            for stage, values in sorted(grouped.items())]


def memory_figure(predicted_mib: dict[str, float], stages: list[StagePeaks]):
    """Predicted components stacked in one bar, then one bar per pipeline stage at the median
    measured peak with a whisker from the lowest to the highest rank; the legend sits outside."""
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = 0.0
    for component, mib in predicted_mib.items():
        ax.bar("predicted", mib, bottom=bottom, label=component)
        bottom += mib
    for s in stages:
        label = f"stage {s.stage}" if len(stages) > 1 else "measured"
        ax.bar(f"{label}\n({s.ranks} rank{'s' if s.ranks > 1 else ''})", s.median, color="tab:gray",
               yerr=[[s.median - s.low], [s.high - s.median]], capsize=4,
               label="measured peak (median; whisker: min-max over ranks)" if s is stages[0] else None)
    ax.set(ylabel="MiB per device", title="memory: predicted components vs measured peak")
    ax.tick_params(axis="x", labelsize="small")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return fig


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")  # keeps a legend placed outside the axes
    plt.close(fig)
    return path


def sweep_report(client: MlflowClient, run, out_dir: Path) -> tuple[str, list[Path]]:
    """A sweep's parent run: its jobs' table and their loss curves, as logged when the sweep ended."""
    run_id, tags = run.info.run_id, run.data.tags
    lines = [f"sweep      {run_id} ({run.info.run_name}), {run.info.status}",
             f"jobs       {tags.get('sweep.jobs', '?')}, {tags.get('sweep.failed', '0')} failed; "
             f"metric {run.data.params.get('sweep.metric', '?')}"]
    if "sweep.best_run_id" in tags:
        lines.append(f"best       job {tags['sweep.best_job']} ({tags['sweep.best_overrides']}), "
                     f"run {tags['sweep.best_run_id']}")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for artifact in ("sweep/jobs.md", "sweep/loss_curves.png"):
        try:
            local = Path(client.download_artifacts(run_id, artifact, str(out_dir)))
        except Exception:  # noqa: BLE001 - a sweep that ended before its comparison was logged
            continue
        if artifact.endswith(".md"):
            lines += ["", local.read_text()]
        written.append(local)
    return "\n".join(lines), written


def summary(client: MlflowClient, run_id: str) -> str:
    """Plan, outcome, throughput, memory and restarts of one run, as text."""
    run = client.get_run(run_id)
    p, m, t = run.data.params, run.data.metrics, run.data.tags
    # Each engine's own settings, as its spec names them (runs before plan.engine existed: DeepSpeed).
    spec = _run_engine(p)
    sharding = spec.tracked_settings if spec else ()
    plan = " ".join(f"{k}={p[f'plan.{k}']}" for k in ("engine", "dp", "tp", "pp", *sharding, "offload_optimizer",
                                                     "activation_checkpointing", "recompute_every_n_layers",
                                                     "precision", "micro_batch_size", "grad_accum_steps")
                    if f"plan.{k}" in p)
    lines = [f"run        {run_id} ({run.info.run_name}), {run.info.status}",
             f"plan       {plan}",
             f"model      {int(p.get('model.param_count', 0)):,} parameters on {t.get('devices', '?')} workers"]
    if "loss" in m:
        lines.append(f"loss       {m['loss']:.4f}" + (f", eval {m['eval_loss']:.4f}" if "eval_loss" in m else ""))
    if "tokens_per_s" in m:
        lines.append(f"throughput {m['tokens_per_s']:,.0f} tokens/s, {m.get('tflops_per_device', 0):.4f} TFLOP/s "
                     f"per device, MFU {100 * m.get('mfu', 0):.1f}%")
    lines += step_time_lines(client, run_id, p, m)
    if "memory/measured_peak_bytes" in m:
        lines.append(f"memory     predicted peak {int(p.get('memory.predicted.total', 0)) / MIB:.1f} MiB, "
                     f"measured {m['memory/measured_peak_bytes'] / MIB:.1f} MiB per device")
        lines += memory_holder_lines(client, run_id)
    lines.append(f"restarts   {t.get('restarts', '0')}")
    if "goodput" in m:
        shares = [(kind, m.get(f"goodput/{kind}_s", 0.0)) for kind in ("training", *LOSSES)]
        lines.append(f"goodput    {100 * m['goodput']:.0f}% of {m.get('goodput/wall_s', 0.0):.1f} s wall: "
                     + ", ".join(f"{kind} {seconds:.1f} s" for kind, seconds in shares if seconds >= 0.05))
    stragglers = sorted((key for key in t if key.startswith("straggler.")), key=lambda k: int(k.split(".")[1]))
    lines += [f"straggler  {t[key]}" for key in stragglers]
    return "\n".join(lines)


def memory_holder_lines(client: MlflowClient, run_id: str) -> list[str]:
    """The largest holders of the largest rank's measured peak, repeated layers summed, when the run
    listed them (``train.memory_probe_detail``: ``memory/at_peak/rank<r>.json``, plain JSON)."""
    import json
    import tempfile

    from orch.tracking.memory_detail import FOLDER, holder_lines

    listed = [a.path for a in client.list_artifacts(run_id, FOLDER) if a.path.endswith(".json")]
    if not listed:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [json.loads(Path(client.download_artifacts(run_id, path, tmp)).read_text()) for path in listed]
    top = max(ranks, key=lambda rank: rank["measured_peak_bytes"] or 0)
    return [f"           at rank {top['rank']}'s peak, largest first:", *holder_lines(top["at_peak"], " " * 11)]


def runs_table(client: MlflowClient, experiment: str, limit: int = 20) -> str:
    """The most recent runs of an experiment, one line each; a sweep's jobs and a tune's trials
    are listed under their parent run, indented."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return f"no experiment named {experiment!r}"
    runs = client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"],
                              max_results=limit * 10)
    children: dict[str, list] = {}
    for run in runs:
        if parent := run.data.tags.get("mlflow.parentRunId"):
            children.setdefault(parent, []).append(run)
    known = {run.info.run_id for run in runs}
    top = [r for r in runs if r.data.tags.get("mlflow.parentRunId") not in known][:limit]
    rows = [("run id", "name", "status", "plan", "loss", "tokens/s")]
    for run in top:
        rows.append(_run_row(run, ""))
        rows += [_run_row(child, "  - ") for child in reversed(children.get(run.info.run_id, []))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def _run_row(run, indent: str) -> tuple[str, ...]:
    p, m, t = run.data.params, run.data.metrics, run.data.tags
    command = t.get("orch.command")
    if command in ("sweep", "tune"):
        plan = f"{command}, {t['sweep.jobs']} jobs" if "sweep.jobs" in t else command
    else:
        spec = _run_engine(p)
        sharding = spec.run_label(p) if spec else p.get("plan.engine", "?")
        plan = f"dp{p.get('plan.dp', '?')} tp{p.get('plan.tp', '?')} pp{p.get('plan.pp', '?')} {sharding}"
    loss = next((f"{m[k]:.4f}" for k in ("loss", "best_eval_loss") if k in m), "-")
    return (indent + run.info.run_id[:12], run.info.run_name or "", run.info.status, plan, loss,
            f"{m['tokens_per_s']:,.0f}" if "tokens_per_s" in m else "-")


def _run_engine(params: dict[str, str]) -> EngineSpec | None:
    """The spec of the engine a run's parameters name (DeepSpeed for runs from before plan.engine
    was tracked); None for an engine this installation does not have."""
    name = params.get("plan.engine", "deepspeed")
    return engine_spec(name) if name in engine_names() else None


def runs_command(uri: str, experiment: str) -> str:
    """`orch runs`: the table of recent runs; a TrackingError (exit 2) when the store cannot be read."""
    client = open_existing(uri)
    return reading(uri, f"the runs of experiment {experiment!r}", lambda: runs_table(client, experiment))


def report_command(uri: str, run_id: str, out_dir: Path) -> tuple[str, list[Path]]:
    """`orch report RUN_ID`: the run's summary and the plots written to ``out_dir``; for a sweep's
    parent run, the comparison of its jobs."""
    client = open_existing(uri)
    run = reading(uri, f"run {run_id}", lambda: client.get_run(run_id))
    if run.data.tags.get("orch.command") == "sweep":
        return reading(uri, f"the sweep of run {run_id}", lambda: sweep_report(client, run, out_dir))
    text = reading(uri, f"run {run_id}", lambda: summary(client, run_id))
    return text, reading(uri, f"the metrics of run {run_id}", lambda: write_plots(client, run_id, out_dir))
