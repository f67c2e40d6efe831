"""Tensor parallelism: the pure parts (rank layout, DeepSpeed config, the GPT's head check) in
milliseconds, then real DeepSpeed AutoTP training on 2 (and 4) CPU workers in Ray actors."""

from __future__ import annotations

import pytest
import torch

from helpers.config import FAST, compose_config
from orch.config import to_typed
from orch.launchers.engines.deepspeed.config import build_ds_config, tensor_parallel_section
from orch.plans.errors import PlanError
from orch.plans.optim_settings import optim_settings
from orch.plans.parallel.rank_layout import ParallelCoords, global_rank, group_stride, parallel_coords
from orch.plans.resolve import resolve_plan
from orch.plans.spec import ClusterSpec, OptimSpec, PlanSpec, TrainSpec
from orch.plans.step_time.cost_model import group_links
from orch.workloads.gpt import GPT, TP_LAYER_SPECS

# --- pure ----------------------------------------------------------------------------------------


def test_tensor_parallel_ranks_are_contiguous_and_data_parallel_outer():
    coords = [parallel_coords(rank, 8, 2) for rank in range(8)]
    assert [(c.dp_rank, c.tp_rank) for c in coords] == [(0, 0), (0, 1), (1, 0), (1, 1),
                                                        (2, 0), (2, 1), (3, 0), (3, 1)]
    assert parallel_coords(5, 8, 4) == ParallelCoords(dp_rank=1, tp_rank=1)
    # tp=1 is pure data parallelism: every rank is its own replica.
    assert [parallel_coords(r, 3, 1).dp_rank for r in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("rank,world,tp", [(0, 6, 4), (0, 4, 0), (4, 4, 2), (-1, 4, 2)])
def test_parallel_coords_refuses_impossible_layouts(rank, world, tp):
    with pytest.raises(ValueError):
        parallel_coords(rank, world, tp)


LAYOUTS = [(8, 2, 1), (8, 2, 2), (16, 4, 2), (12, 1, 3), (6, 3, 1)]  # (world, tp, pp)


@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
def test_global_rank_inverts_parallel_coords(world, tp, pp):
    for rank in range(world):
        c = parallel_coords(rank, world, tp, pp)
        assert global_rank(c.dp_rank, c.pp_rank, c.tp_rank, tp=tp, pp=pp) == rank


@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
@pytest.mark.parametrize("devices_per_node", [1, 2, 4, 8])
def test_group_strides_match_the_layout_and_group_links(world, tp, pp, devices_per_node):
    """Each group of rank 0, found by brute force over parallel_coords, is ``0, stride, 2 * stride, ...``;
    whether it crosses nodes agrees with group_links' closed form."""
    coords = [parallel_coords(r, world, tp, pp) for r in range(world)]
    same = {"tp": lambda c: (c.dp_rank, c.pp_rank), "pp": lambda c: (c.dp_rank, c.tp_rank),
            "dp": lambda c: (c.pp_rank, c.tp_rank)}
    links = group_links(world, devices_per_node, tp, pp)
    for kind, key in same.items():
        members = [r for r in range(world) if key(coords[r]) == key(coords[0])]
        stride = group_stride(kind, tp, pp)
        assert members == list(range(0, len(members) * stride, stride))
        crosses = len({r // devices_per_node for r in members}) > 1
        assert getattr(links, kind) == ("inter" if crosses else "intra")


def test_ds_config_shards_the_gpt_only_with_tp():
    plan = resolve_plan(PlanSpec(tp=2, dp=1, micro_batch_size=8), ClusterSpec(), TrainSpec())
    optim = optim_settings(plan, OptimSpec(), 10)
    with pytest.raises(ValueError, match="plan.tp=2 needs the model's tensor-parallel layer specs"):
        build_ds_config(plan, optim)  # no default: one model's specs never shard another
    config = build_ds_config(plan, optim, tp_layer_specs=TP_LAYER_SPECS)
    assert config["tensor_parallel"] == {
        "autotp_size": 2,
        "partition_config": {"use_default_specs": False, "layer_specs": TP_LAYER_SPECS},
    }
    # The batch is counted per data-parallel replica: the two ranks share their 8 samples.
    assert config["train_batch_size"] == 8 and config["train_micro_batch_size_per_gpu"] == 8
    plain = resolve_plan(PlanSpec(), ClusterSpec(), TrainSpec())
    assert "tensor_parallel" not in build_ds_config(plain, optim_settings(plain, OptimSpec(), 10))


def test_ds_config_takes_a_models_own_layer_specs():
    plan = resolve_plan(PlanSpec(tp=2, dp=1), ClusterSpec(), TrainSpec())
    specs = [{"patterns": [r".*\.w_in\.weight$"], "partition_type": "column"},
             {"patterns": [r".*\.w_out\.weight$"], "partition_type": "row"}]
    section = build_ds_config(plan, optim_settings(plan, OptimSpec(), 10), tp_layer_specs=specs)["tensor_parallel"]
    assert section["partition_config"]["layer_specs"] == specs
    with pytest.raises(ValueError, match="plan.tp=2 needs the model's tensor-parallel layer specs"):
        tensor_parallel_section(2, [])


def test_gpt_layer_specs_match_the_layers_meant_and_nothing_else():
    from deepspeed.module_inject.autotp_config import AutoTPConfig, PartitionType

    config = AutoTPConfig.from_dict({"layer_specs": TP_LAYER_SPECS})
    kinds = {}
    for name, _ in GPT(n_layer=2).named_parameters():
        spec = config.find_matching_spec(name)
        kinds[name] = spec.partition_type if spec else None
    assert kinds["blocks.1.attn.qkv.weight"] == PartitionType.COLUMN
    assert kinds["blocks.1.mlp.fc.weight"] == PartitionType.COLUMN
    assert kinds["blocks.0.attn.proj.weight"] == PartitionType.ROW
    assert kinds["blocks.0.mlp.proj.weight"] == PartitionType.ROW
    sharded = {n for n, k in kinds.items() if k is not None}
    assert sharded == {f"blocks.{i}.{layer}.weight" for i in range(2)
                       for layer in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}


def test_the_planners_tensor_parallel_count_is_what_sharding_leaves_on_a_rank():
    """The parameters counted as split by tp are exactly those the meta shard shrinks: a layer its
    spec skips stays whole in both."""
    from orch.plans.memory.estimate import _tensor_parallel_params
    from orch.plans.parallel.tp_plan import shard_module

    specs = [*TP_LAYER_SPECS, {"patterns": [r".*blocks\.0\.mlp\.fc\.weight$"], "partition_type": "skip"}]
    specs = [specs[-1], *specs[:-1]]  # the first matching spec decides: the skip wins for block 0's fc
    with torch.device("meta"):
        model = GPT(n_layer=2)
    whole = sum(p.numel() for p in model.parameters())
    sharded, _ = _tensor_parallel_params(model, specs)
    on_rank = sum(p.numel() for p in shard_module(model, specs, 2).parameters())
    assert on_rank == whole - sharded // 2
    fc = model.blocks[0].mlp.fc
    assert fc.weight.shape[0] == 4 * 128, "the skipped layer stays whole"


def test_gpt_heads_must_split_evenly_over_tp():
    with pytest.raises(ValueError, match=r"model.n_head\(6\) must be divisible by plan.tp\(4\)"):
        GPT(d_model=96, n_head=6, tp=4)
    GPT(d_model=96, n_head=6, tp=3)


def test_the_planner_names_model_and_tp_when_heads_do_not_split():
    from orch.checking import check_run

    cfg = compose_config("plan.tp=2", "plan.dp=1", "model.n_head=1", "model.d_model=64")
    typed, model_cfg, _ = to_typed(cfg)
    with pytest.raises(PlanError) as info:
        check_run(typed, model_cfg)
    violation = info.value.violations[0]
    assert violation.field == "model.n_head" and violation.value == 1
    assert "model.n_head(1) must be divisible by plan.tp(2)" in violation.message


def test_gpt_attention_runs_on_a_head_shard():
    # What a plain column split (AutoTP's, DTensor's) leaves on one rank: qkv keeps this rank's
    # half of its rows, which are whole heads with their q, k and v, and proj its columns. The
    # forward reads the local head count off the width, and the two ranks' partial proj outputs
    # sum (the all-reduce) to the whole attention output.
    torch.manual_seed(0)
    attn = GPT(d_model=32, n_head=4).blocks[0].attn
    x = torch.randn(2, 5, 32)
    whole = attn(x)
    partial = []
    for rank in range(2):
        shard = GPT(d_model=32, n_head=4).blocks[0].attn
        rows = torch.arange(48) + rank * 48
        shard.qkv.weight = torch.nn.Parameter(attn.qkv.weight[rows])
        shard.qkv.bias = torch.nn.Parameter(attn.qkv.bias[rows])
        shard.proj.weight = torch.nn.Parameter(attn.proj.weight[:, rank * 16:(rank + 1) * 16])
        shard.proj.bias = torch.nn.Parameter(attn.proj.bias / 2)
        partial.append(shard(x))
    torch.testing.assert_close(partial[0] + partial[1], whole)


# --- real DeepSpeed AutoTP in Ray actors ---------------------------------------------------------


def train(sqlite_uri: str, *overrides: str):
    from orch.run.driver import run_training

    cfg = compose_config(*FAST, f"tracking.uri={sqlite_uri}", *overrides)
    return run_training(*to_typed(cfg))


@pytest.mark.slow
def test_dp2_by_tp2_on_four_workers_follows_the_data_parallel_loss_curve(dp_reference, local_ray, sqlite_uri):
    """4 workers on this 2-core machine: half a CPU each. TP groups are ranks (0, 1) and (2, 3);
    each group reads its dp shard, the same shards the two ranks of a plain dp=2 run read.

    Same global batch (8) and seed as the dp=2 reference, so both runs take the same optimizer
    steps on the same data. What differs is summation order (the tp all-reduces), ~1e-7 per step
    in fp32; 1e-3 leaves room for Adam to amplify that over 30 steps and is still 500 times
    smaller than the loss falls between two logged steps."""
    four = ["plan.dp=2", "plan.tp=2", "plan.zero_stage=1", "cluster.devices_per_node=4", "cluster.cpus_per_worker=0.5"]
    grid = train(sqlite_uri, *four)
    dp = dp_reference  # ZeRO-1: the same Adam steps as ZeRO-0, on a flat fp32 partition
    assert [(f.dp_rank, f.tp_rank) for f in grid.worker_facts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first, last = grid.reports[0], grid.reports[-1]
    assert last[0].loss < first[0].loss - 0.5, (first[0].loss, last[0].loss)
    digests = [r.first_batch_digest for r in first]
    assert digests[0] == digests[1] != digests[2] == digests[3]
    assert digests[0::2] == [r.first_batch_digest for r in dp.reports[0]]
    # One replica split in two: both ranks of a tp group read the same batch and, since the output
    # head is replicated and the row-parallel all-reduce gives both the same sum, compute the same loss.
    for reports in grid.reports:
        assert reports[0].local_loss == reports[1].local_loss and reports[2].local_loss == reports[3].local_loss
        assert len({r.loss for r in reports}) == 1
    assert len({r.evaluation["eval_loss"] for r in last}) == 1
    assert dp.plan.global_batch_size == grid.plan.global_batch_size == 8
    assert [r[0].loss for r in grid.reports] == pytest.approx([r[0].loss for r in dp.reports], abs=1e-3)
    assert grid.eval_loss == pytest.approx(dp.eval_loss, abs=1e-3)
