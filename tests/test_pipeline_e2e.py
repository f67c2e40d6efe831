"""`orch train plan.engine=fsdp2 plan.pp=2`: torch's pipeline schedules in real Ray actors.

Each schedule must compute what the unpipelined model computes: the same layers from the same
seeds, the same micro-batches, gradients averaged alike. So the losses of the first steps equal
the pp=1 run's, and a pipelined checkpoint (saved under the whole model's names) resumes at
another dp, tp and pp. The schedule arithmetic and the renaming are unit-tested in
tests/test_pipeline_schedules.py.
"""

from __future__ import annotations

import shutil

import pytest

from helpers.config import compose_config
from orch.config import to_typed
from orch.run.driver import run_training

pytestmark = pytest.mark.slow

STEPS = ["train.steps=10", "train.log_every=1", "train.eval_batches=2", "plan.micro_batch_size=4",
         "plan.grad_accum_steps=2"]


def train(sqlite_uri: str, *overrides: str):
    cfg = compose_config(*STEPS, f"tracking.uri={sqlite_uri}", "plan.engine=fsdp2", *overrides)
    return run_training(*to_typed(cfg))


def losses(result) -> list[float]:
    return [r[0].loss for r in result.reports]


def test_gpt_pipeline_schedules_give_the_unpipelined_losses(local_ray, sqlite_uri):
    """GPT of 4 blocks (7 pipeline layers) at pp=2: 1F1B with selective recomputation and each
    sequence split over 2 context-parallel ranks (4 workers: the embedding numbers its part's
    tokens, attention gathers the other rank's keys), interleaved 1F1B over 2 stages per rank with
    full recomputation of every 2nd block at tp=2 (4 workers: the tied embedding's copies on the
    first and last stage, on different ranks, both split over the vocabulary, their gradient shards
    summed), the looped zero-bubble schedule over 2 stages per rank (each weight backward split
    from its input backward and run later), and ZB-V (its two stages in a V, the tied embedding and
    head both on rank 0, saying what was alive at its memory peak): the first 10 losses are the
    pp=1 run's."""
    gpt = ["model.n_layer=4"]
    reference = train(sqlite_uri, *gpt, "cluster.devices_per_node=1")
    expected = losses(reference)
    assert len(expected) == 10 and expected[-1] < expected[0]
    runs = {
        "1f1b": ["plan.pp_schedule=1f1b", "plan.activation_checkpointing=selective", "plan.cp=2",
                 "cluster.devices_per_node=4", "cluster.cpus_per_worker=0.5"],
        "interleaved_1f1b": ["plan.pp_schedule=interleaved_1f1b", "plan.pp_virtual_stages=2",
                             "plan.activation_checkpointing=full", "plan.recompute_every_n_layers=2", "plan.tp=2",
                             "cluster.devices_per_node=4", "cluster.cpus_per_worker=0.5"],
        "zero_bubble": ["plan.pp_schedule=zero_bubble", "plan.pp_virtual_stages=2",
                        "plan.fsdp.reshard_after_forward=false"],
        "zbv": ["plan.pp_schedule=zbv", "plan.pp_virtual_stages=2", "plan.fsdp.reshard_after_forward=false",
                "train.memory_probe_detail=true"],
    }
    for schedule, overrides in runs.items():
        result = train(sqlite_uri, *gpt, "plan.pp=2", *overrides)
        assert result.plan.pp == 2 and result.plan.pp_schedule.value == schedule
        assert result.plan.dp == 1 and len(result.worker_facts) == 2 * result.plan.cp * result.plan.tp
        split = [f for f in result.worker_facts if "split over the vocabulary with its tied embedding" in f.model.built]
        assert len(split) == (4 if result.plan.tp == 2 else 0), schedule
        assert losses(result) == pytest.approx(expected, abs=1e-4), schedule
        # Each rank built only its own stages.
        assert all(f.model.params_on_rank < result.model.param_count for f in result.worker_facts)
        assert "stages" in result.worker_facts[0].model.built
    # What was alive at ZB-V's peak, adding up to each rank's measured peak: naming modules by
    # their forward only leaves its split backward as it runs (hooks on module outputs broke it).
    detailed = next(reports for reports in result.reports if reports[0].memory_at_peak)
    for report in detailed:
        assert sum(entry["bytes"] for entry in report.memory_at_peak) == report.measured_peak_bytes
        what = [entry["what"] for entry in report.memory_at_peak]
        assert "parameters" in what and any(w.startswith("forward: aten.addmm in ") for w in what), what


def test_a_pipelined_checkpoint_resumes_at_another_dp_tp_and_pp(local_ray, sqlite_uri, tmp_path):
    """A Llama-shaped Hugging Face decoder checkpointed at (dp=2, pp=2) on 4 workers resumes, from
    the same step and with the same global batch, at (dp=2, pp=1), at (dp=1, tp=2), at
    (tp=2, pp=2) with the sequence split over tp and at (pp=2, cp=2) compiled, each sequence split
    over two ranks of each stage (the decoder layers' rotary angles and mask computed, eagerly, for
    their part's positions): DCP reshards the whole model's names whichever stage wrote them, and
    the runs go on to the same losses. The head is untied: the runs at tp=2 split it over the vocabulary
    (``plan.loss_parallel``; with pp=2 on the last stage), from a checkpoint of a whole head."""
    # Four workers on the tests' 2-CPU Ray: half a CPU each.
    hf = ["model=hf_causal_lm", "model.config.num_hidden_layers=4", "model.config.tie_word_embeddings=false",
          "cluster.cpus_per_worker=0.5"]
    ckpt = tmp_path / "ckpt"
    first = train(sqlite_uri, *hf, "cluster.devices_per_node=4", "plan.dp=2", "plan.pp=2", "train.steps=5",
                  "train.checkpoint_every=5", f"train.checkpoint_dir={ckpt}")
    assert (first.plan.dp, first.plan.pp) == (2, 2) and len(first.reports) == 5
    # In this order each layout after the first takes the workers of the run before it when it has
    # as many (tests/helpers/ray_cluster.py): one group of four for the runs of four, then one of two.
    layouts = {
        "tp=2 pp=2 sequence-parallel": ["cluster.devices_per_node=4", "plan.tp=2", "plan.pp=2",
                                        "plan.grad_accum_steps=4", "plan.sequence_parallel=true"],
        "pp=2 cp=2 compiled": ["cluster.devices_per_node=4", "plan.cp=2", "plan.pp=2", "plan.grad_accum_steps=4",
                               "plan.compile=true"],
        "dp=2 pp=1": ["cluster.devices_per_node=2", "plan.dp=2"],
        "dp=1 tp=2": ["cluster.devices_per_node=2", "plan.tp=2", "plan.grad_accum_steps=4"],
    }
    resumed = {}
    for name, overrides in layouts.items():
        folder = tmp_path / name.replace(" ", "_").replace("=", "")
        shutil.copytree(ckpt, folder)
        result = train(sqlite_uri, *hf, *overrides, "train.resume=auto", f"train.checkpoint_dir={folder}")
        assert [r[0].step for r in result.reports] == [6, 7, 8, 9, 10], name
        split = [f for f in result.worker_facts if "the output head split over the vocabulary" in f.model.built]
        # At tp=2 both ranks holding the head split it: the two of the last stage with pp=2.
        assert len(split) == (2 if result.plan.tp == 2 else 0), (name, [f.model.built for f in result.worker_facts])
        context = [f for f in result.worker_facts if "split over 2 context-parallel ranks" in f.model.built]
        assert len(context) == (4 if result.plan.cp == 2 else 0), name
        assert all("compiled" in f.model.built for f in result.worker_facts) == result.plan.compile, name
        resumed[name] = losses(result)
    reference = resumed.pop("dp=2 pp=1")
    assert reference[-1] < first.reports[-1][0].loss
    for name, found in resumed.items():
        assert found == pytest.approx(reference, abs=1e-3), name
