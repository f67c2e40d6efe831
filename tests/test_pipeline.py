"""Pipeline parallelism: the pure rules and stage split in milliseconds, then real DeepSpeed
PipelineModule training on 2 CPU workers in Ray actors."""

from __future__ import annotations

import pytest
import torch

from helpers.config import FAST, compose_config, lm_inputs
from orch.checking import check_run
from orch.config import to_typed
from orch.models import pipeline_layers_factory
from orch.plans.errors import PlanError
from orch.plans.parallel.pipeline import bubble_fraction, measure_pipeline_layers, pipeline_stages
from orch.plans.resolve import resolve_plan
from orch.plans.spec import ClusterSpec, PlanSpec, TrainSpec
from orch.workloads.gpt import GPT

# --- pure ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_pipelines_refuse_zero_stages_the_pipeline_engine_does_not_run(stage):
    with pytest.raises(PlanError) as info:
        resolve_plan(PlanSpec(pp=2, dp=1, zero_stage=stage), ClusterSpec(), TrainSpec())
    violation = info.value.violations[0]
    assert violation.field == "plan.zero_stage" and violation.value == stage
    assert "pipeline engine trains with ZeRO stages 0, 1 only" in violation.message
    assert "set plan.zero_stage=1, or plan.pp=1" in violation.fix


def test_pipeline_partition_must_be_one_deepspeed_knows():
    with pytest.raises(PlanError, match=r"plan.pp_partition"):
        resolve_plan(PlanSpec(pp=2, dp=1, pp_partition="by_magic"), ClusterSpec(), TrainSpec())
    for method in ("parameters", "uniform", "type:Block"):
        assert resolve_plan(PlanSpec(pp=2, dp=1, pp_partition=method), ClusterSpec(), TrainSpec()).pp == 2


def test_gpt_built_whole_and_as_pipeline_layers_starts_from_the_same_weights():
    torch.manual_seed(7)
    whole = GPT(n_layer=2, d_model=32, n_head=2, seq_len=16)
    torch.manual_seed(7)
    specs = GPT.pipeline_layers(n_layer=2, d_model=32, n_head=2, seq_len=16)
    layers = [spec.build() for spec in specs]
    torch.testing.assert_close(layers[0].wte.weight, whole.embed.wte.weight)
    torch.testing.assert_close(layers[2].mlp.fc.weight, whole.blocks[1].mlp.fc.weight)
    # And they compute the same logits, the tied head reusing the embedding.
    ids = torch.randint(0, 256, (2, 16))
    x = ids
    for spec, layer in zip(specs, layers, strict=True):
        x = spec.forward_fn(layer, x) if getattr(spec, "forward_fn", None) else layer(x)
    torch.testing.assert_close(x, whole(ids))


def test_stages_split_the_layers_as_deepspeed_does():
    specs = GPT.pipeline_layers(n_layer=4, d_model=64, n_head=2, seq_len=16)
    layers = measure_pipeline_layers(specs, micro_batch_size=2, inputs=lm_inputs(16), dtype=torch.float32)
    assert [layer.name for layer in layers] == ["Embedding", "Block", "Block", "Block", "Block", "LayerNorm",
                                                "Embedding"]
    stages = pipeline_stages(layers, pp=2, method="type:Block", micro_batches=4, engine="deepspeed")
    assert [(s.start, s.stop) for s in stages] == [(0, 3), (3, 7)]  # two blocks each
    assert [s.in_flight for s in stages] == [2, 1]  # 1F1B: the first stage holds the most
    # Every layer saves activations; the head also holds the logits and the loss's fp32
    # log-softmax, each micro-batch x seq_len x vocab.
    assert all(layer.saved_bytes > 0 for layer in layers)
    assert layers[-1].saved_bytes > 2 * (2 * 16 * 256 * 4)
    # What a split backward keeps for its weight pass: the output of every call where a weight meets
    # the input. A block: its two layer norms, qkv (3 d), attention's and the MLP's projections,
    # the MLP's 4 d; the tied head's logits, computed from the embedding's weight.
    hidden = 2 * 16 * 64 * 4
    assert [layer.weight_grad_bytes for layer in layers[1:]] == [11 * hidden] * 4 + [hidden, 2 * 16 * 256 * 4]
    assert bubble_fraction(2, 4) == 0.25


def test_check_shows_pipeline_stages_and_the_bubble():
    typed, model_cfg, _ = to_typed(compose_config("plan.pp=2", "plan.dp=1", "plan.grad_accum_steps=2"))
    estimate, _ = check_run(typed, model_cfg)
    assert len(estimate.stages) == len(estimate.pipeline) == 2
    assert estimate.bubble == 0.5
    assert estimate.per_device.total == max(s.total for s in estimate.stages)
    doc = estimate.as_json()
    assert doc["pipeline"]["bubble_fraction"] == 0.5
    assert [s["index"] for s in doc["pipeline"]["stages"]] == [0, 1]


def test_more_stages_than_layers_with_parameters_is_refused_before_launch():
    cfg = compose_config("plan.pp=6", "plan.dp=1", "cluster.devices_per_node=6", "model.n_layer=1")
    typed, model_cfg, _ = to_typed(cfg)
    with pytest.raises(PlanError) as info:
        check_run(typed, model_cfg)
    violation = info.value.violations[0]
    assert violation.field == "plan.pp" and violation.value == 6
    assert "has 4 pipeline layers, 4 of them with parameters" in violation.message
    assert "set plan.pp to at most 4" in violation.fix


def test_a_model_without_pipeline_layers_is_refused_with_the_reason():
    assert pipeline_layers_factory({"_target_": "faulty_models.UnpipelinedGPT"}) is None
    cfg = compose_config("plan.pp=2", "plan.dp=1", "model._target_=faulty_models.UnpipelinedGPT")
    typed, model_cfg, _ = to_typed(cfg)
    with pytest.raises(PlanError, match=r"faulty_models.UnpipelinedGPT cannot be split into pipeline stages"):
        check_run(typed, model_cfg)


# --- real DeepSpeed pipelines in Ray actors ------------------------------------------------------


def train(sqlite_uri: str, *overrides: str):
    from orch.run.driver import run_training

    cfg = compose_config(*FAST, f"tracking.uri={sqlite_uri}", *overrides)
    return run_training(*to_typed(cfg))


@pytest.mark.slow
def test_pipelines_follow_the_data_parallel_loss_curve_and_a_3d_checkpoint_resumes_the_same_run(
        dp_reference, local_ray, sqlite_uri, tmp_path):
    # Same global batch (8) and seed: dp=2 with one micro-batch of 4 per rank; pp=2 (and
    # tp=2 x pp=2 on 4 workers) with one replica running two micro-batches of 4 through two
    # stages. dp=1 reads the permutation's first 8 samples in two micro-batches of 4, the same 8
    # the two dp=2 ranks read (see test_tensor_parallel), and every run starts from the same
    # weights (per-layer seeds). What differs is summation order (a mean over micro-batches vs
    # over ranks, the tied embedding's gradient summed across the two stages holding it, the
    # row-parallel all-reduces): ~1e-7 per step in fp32. 1e-3 leaves room for Adam to amplify
    # that over 30 steps and is still hundreds of times smaller than the loss falls between two
    # logged steps. Gradient clipping is on (optim.grad_clip=1): a pipeline whose norm missed a
    # stage's gradients would clip differently and leave this tolerance within a few steps.
    # train.eval_batches counts micro-batches per replica: the one pipeline replica evaluates
    # twice as many as each of dp's two, so both runs evaluate the same 16 samples.
    dp = dp_reference
    one_replica = ["plan.dp=1", "plan.pp=2", "plan.micro_batch_size=4", "plan.grad_accum_steps=2",
                   "train.eval_batches=4"]
    pp = train(sqlite_uri, *one_replica)
    # The tp=2 x pp=2 run checkpoints under ZeRO-1 (the shipped pipeline plan's stage; with one
    # replica its Adam steps are ZeRO-0's, as dp's ZeRO-1 reference's are): every rank writes its
    # own shard of its own stage, and the checkpoint is published only once all four have.
    three_d = [*one_replica, "plan.tp=2", "plan.zero_stage=1", "cluster.devices_per_node=4",
               "cluster.cpus_per_worker=0.5", "train.checkpoint_every=10", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
               "train.resume=auto"]
    grid = train(sqlite_uri, *three_d)
    assert [(f.dp_rank, f.pp_rank) for f in pp.worker_facts] == [(0, 0), (0, 1)]
    assert [(f.pp_rank, f.tp_rank) for f in grid.worker_facts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # Each stage holds its own layers only, as the planner split them; tp halves the blocks' share.
    assert [f.model.params_on_rank for f in pp.worker_facts] == [s.params for s in pp.estimate.pipeline]
    assert all(f.model.params_on_rank < s.params for f, s in zip(grid.worker_facts[::2], grid.estimate.pipeline,
                                                                strict=True))
    # The two ranks of a tensor-parallel group read the same batch on the first stage.
    assert grid.reports[0][0].first_batch_digest == grid.reports[0][1].first_batch_digest
    first, last = pp.reports[0], pp.reports[-1]
    assert last[0].loss < first[0].loss - 0.5
    for run in (pp, grid):
        for reports in run.reports:  # the loss comes back from the last stage to every stage
            assert len({r.loss for r in reports}) == 1
        assert [r[0].loss for r in run.reports] == pytest.approx([r[0].loss for r in dp.reports], abs=PARITY)
        assert run.eval_loss == pytest.approx(dp.eval_loss, abs=PARITY)

    # The 3D run resumes from its checkpoint as the same run.
    after = train(sqlite_uri, *three_d, "train.steps=40")
    assert after.run_id == grid.run_id
    assert {f.start_step for f in after.worker_facts} == {30}
    # One file per layer and tensor-parallel rank, and one ZeRO file per model-parallel rank (pipe x tp).
    assert len(list((tmp_path / "ckpt" / "step_000000040").glob("zero_pp_rank_0_mp_rank_*_optim_states.pt"))) == 4
    assert [r[0].step for r in after.reports] == [35, 40]
    # Training went on from the checkpoint: the loss right after resuming is where it had got to,
    # far below a fresh start's (ln 256 = 5.5).
    assert after.reports[0][0].loss < grid.reports[0][0].loss - 0.5


PARITY = 1e-3
