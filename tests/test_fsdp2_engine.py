"""The FSDP2 engine (:mod:`orch.launchers.engines.fsdp2`) on its own, without the worker loop.

Pure parts first (the schedule against DeepSpeed's, the optimizer, the blocks found, the
metadata unpickler); then ranks started with ``torch.multiprocessing`` on gloo (marked slow):
the built-in GPT in bf16 with activation checkpointing at dp=2, saved and resumed at dp=1, a
tampered checkpoint refused, an HF Llama shape at tp=2 resumed at tp=1, and a torchvision ViT in
fp16, hybrid-sharded and offloaded.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil

import pytest
import torch

from helpers.processes import free_port
from orch.launchers.engines.fsdp2.dcp_files import read_client_state, read_metadata, write_client_state
from orch.launchers.engines.fsdp2.layout import repeated_blocks
from orch.launchers.engines.fsdp2.torch_optim import build_optimizer, lr_schedule
from orch.launchers.safe_load import UnsafeCheckpointError


def _settings(steps: int, warmup: int, name: str = "adamw", precision: str = "bf16"):
    """A DeepSpeed plan and its run's optimizer settings: what a DeepSpeed run would be given."""
    from orch.plans.optim_settings import optim_settings
    from orch.plans.resolve import ResolvedPlan
    from orch.plans.spec import Accelerator, Offload, OptimizerName, OptimSpec, Precision

    plan = ResolvedPlan(dp=1, tp=1, pp=1, world_size=1, zero_stage=3, offload_optimizer=Offload.none,
                        offload_param=Offload.none, nvme_path=None, activation_checkpointing=False,
                        micro_batch_size=1, grad_accum_steps=1, precision=Precision(precision),
                        accelerator=Accelerator.cpu)
    optim = OptimSpec(name=OptimizerName(name), lr=0.1, warmup_steps=warmup, min_lr_ratio=0.1, momentum=0.9)
    return plan, optim_settings(plan, optim, steps)


@pytest.mark.parametrize(("steps", "warmup"), [(20, 5), (10, 1), (5, 10)])
def test_schedule_gives_the_lr_deepspeed_gives_at_every_step(steps, warmup):
    """DeepSpeed builds ``WarmupCosineLR`` from its config before the first step and steps it after
    each optimizer step; the torch schedule built from the same settings must give every step the
    same lr (0 on the first two, as DeepSpeed's warm-up does)."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from orch.launchers.engines.deepspeed.config import build_ds_config

    plan, settings = _settings(steps, warmup)
    ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = lr_schedule(ours, settings.schedule)
    reference = WarmupCosineLR(theirs, **build_ds_config(plan, settings)["scheduler"]["params"])
    lrs = []
    for _ in range(steps + 3):
        lrs.append(ours.param_groups[0]["lr"])
        assert lrs[-1] == pytest.approx(theirs.param_groups[0]["lr"], abs=1e-12)
        ours.step()  # no gradients: the step changes nothing, but comes before the schedule's, as in training
        schedule.step()
        reference.step()
    assert lrs[:2] == [0.0, 0.0] and max(lrs) > 0


def test_optimizer_is_the_one_deepspeed_would_run():
    from orch.launchers.engines.deepspeed.config import build_ds_config

    params = [torch.nn.Parameter(torch.zeros(2))]
    plan, settings = _settings(10, 2)
    adamw = build_optimizer(params, settings, "cpu")
    written = build_ds_config(plan, settings)["optimizer"]["params"]
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["fused"]
    assert adamw.defaults["betas"] == (0.9, 0.95) == tuple(written["betas"])
    assert (adamw.defaults["lr"], adamw.defaults["eps"], adamw.defaults["weight_decay"]) == (
        written["lr"], written["eps"], written["weight_decay"]) == (0.1, 1e-8, 0.01)
    # DeepSpeed's "Adam" decouples weight decay (its adam_w_mode default), so torch's is AdamW too.
    assert type(build_optimizer(params, _settings(10, 2, "adam")[1], "cpu")) is torch.optim.AdamW
    assert "foreach" in build_optimizer(params, settings, "cpu", fused=False).defaults
    sgd = build_optimizer(params, _settings(10, 2, "sgd")[1], "cpu")
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9


def test_loss_scaler_starts_where_deepspeeds_fp16_section_does():
    import dataclasses

    from orch.launchers.engines.deepspeed.config import build_ds_config
    from orch.launchers.engines.fsdp2.torch_optim import LOSS_SCALE_WINDOW, loss_scaler

    plan, settings = _settings(10, 2, precision="fp16")
    fp16 = build_ds_config(plan, settings)["fp16"]
    assert fp16 == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    dynamic = loss_scaler(settings.loss_scaling, "cpu")
    assert dynamic.get_scale() == 2.0 ** fp16["initial_scale_power"]
    assert dynamic.get_growth_interval() == LOSS_SCALE_WINDOW
    with pytest.raises(ValueError, match=r"loss_scale=128.0: a static fp16 loss scale has no torch counterpart"):
        loss_scaler(dataclasses.replace(settings.loss_scaling, loss_scale=128.0), "cpu")


def test_blocks_are_the_repeated_layers_of_each_kind_of_model():
    from torchvision.models import resnet18

    from helpers.fsdp2_ranks import gpt, llama, vit

    model = gpt()
    assert repeated_blocks(model) == list(model.blocks)
    model = llama()
    assert repeated_blocks(model) == list(model.model.layers)
    model = vit()
    assert repeated_blocks(model) == list(model.encoder.layers)
    model = resnet18(num_classes=10)
    assert repeated_blocks(model) == [*model.layer1, *model.layer2, *model.layer3, *model.layer4]
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert repeated_blocks(mlp) == []


def test_autotp_specs_shard_under_fsdp2_the_layers_deepspeed_and_the_planner_shard():
    """The first matching spec decides and a skip leaves its layer whole, as in DeepSpeed's AutoTP
    and the planner's count; a fused layer's spec is refused."""
    from orch.launchers.engines.fsdp2.layout import autotp_styles
    from orch.plans.parallel.tp_plan import layer_kinds

    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4), torch.nn.Linear(4, 4))
    specs = [{"patterns": [r"^3\.weight$"], "partition_type": "skip"},
             {"patterns": [r"^0\.weight$", r"^3\.weight$"], "partition_type": "column"},
             {"patterns": [r"^2\.weight$"], "partition_type": "row"}]
    assert autotp_styles(mlp, specs) == {"0": "column", "2": "row"}
    assert layer_kinds(mlp, specs) == {"0": "column", "2": "row", "3": "skip"}
    with pytest.raises(RuntimeError, match="splits a fused layer"):
        autotp_styles(mlp, [{"patterns": [r"^0\.weight$"], "partition_type": "column", "shape": [3, -1]}])


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def test_metadata_naming_anything_but_dcp_data_is_refused(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: DCP metadata names posix\.system"):
        read_metadata(path)


def test_client_state_is_json_with_the_rng_as_numbers(tmp_path):
    rng = torch.get_rng_state()
    write_client_state(tmp_path, {"step": 3, "rng": rng, "data": {"position": 5}, "loss": 1.5})
    assert json.loads((tmp_path / "client_state.json").read_text())["rng"]["dtype"] == "uint8"
    state = read_client_state(tmp_path)
    assert torch.equal(state["rng"], rng) and state["step"] == 3 and state["data"] == {"position": 5}
    with pytest.raises(TypeError, match="holds a object"):
        write_client_state(tmp_path, {"odd": object()})


def test_crafted_client_state_is_refused_naming_the_file(tmp_path):
    (tmp_path / "client_state.json").write_text("[" * 100_000 + "]" * 100_000)  # deeper than json recurses
    with pytest.raises(UnsafeCheckpointError, match=r"client_state.json is not the loop's state \(RecursionError"):
        read_client_state(tmp_path)
    (tmp_path / "client_state.json").write_text("[1, 2]")
    with pytest.raises(UnsafeCheckpointError, match="holds a list"):
        read_client_state(tmp_path)


def test_data_files_the_metadata_names_are_checked_before_dcp_reads_them(tmp_path):
    """Written by DCP in one process (as `orch export` reads one back): a shard cut short or missing
    is named with what is wrong, and a .metadata naming a file outside the checkpoint is refused;
    DCP's own failure (a BaseException) is turned into one naming the checkpoint and the rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from orch.launchers.engines.fsdp2.dcp_files import CheckpointReadError, dcp_failure, full_model_state

    folder = tmp_path / "step_000000010"
    dcp.save({"model": {"w": torch.arange(64.0)}}, checkpoint_id=str(folder), no_dist=True)
    assert torch.equal(full_model_state(folder)["w"], torch.arange(64.0))
    [shard] = folder.glob("*.distcp")
    whole = shard.read_bytes()

    shard.write_bytes(whole[:40])
    with pytest.raises(CheckpointReadError, match=rf"checkpoint file {shard} is cut short: 40 bytes, where the "):
        full_model_state(folder)
    shard.unlink()
    with pytest.raises(CheckpointReadError, match=rf"checkpoint file {shard} is missing"):
        full_model_state(folder)
    shard.write_bytes(whole)

    outside = tmp_path / "outside.distcp"
    outside.write_bytes(whole)
    metadata = read_metadata(folder / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match=r"names the data file '../outside.distcp', which is not a plain"):
        full_model_state(folder)

    failure = dcp_failure(folder, CheckpointException("load failed", {1: (EOFError("ran out of input"), None)}))
    assert str(failure).startswith(f"checkpoint {folder} could not be read (rank 1: EOFError: ran out of input)")


def _spawn(scenario: str, world: int, out, **kwargs) -> dict:
    from helpers.fsdp2_ranks import spawn

    spawn(scenario, world, out, free_port(), **kwargs)
    return json.loads((out / f"{scenario}.json").read_text())


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """The GPT at dp=2 in bf16 with activation checkpointing and 2 micro-batches a step: 6 steps,
    saved and published at step 6."""
    out = tmp_path_factory.mktemp("fsdp2-gpt")
    return out, _spawn("train_and_save", 2, out, model="gpt", checkpointing=True)


@pytest.mark.slow
def test_gpt_trains_in_bf16_and_consolidates_to_the_models_own_keys(gpt_run):
    _, found = gpt_run
    losses = found["losses"]
    # DeepSpeed's schedule (and so ours) gives lr 0 to the first two steps, then the loss falls.
    assert losses[0] == losses[1] == losses[2]
    assert losses[3] < losses[2] and losses[-1] < losses[0] - 0.5
    assert found["losses"][0] == pytest.approx(found["whole_first_loss"], rel=5e-3)  # bf16 against fp32
    assert found["params_on_rank"] == found["params_at_build"] // 2
    assert found["consolidated_shapes"] == found["whole_shapes"]
    # Built on meta on every rank, filled from rank 0's whole build: the first loss above is that model's.
    assert found["built"] == "on meta, fully_shard on 2 blocks and the root, then filled from rank 0's whole build"


@pytest.mark.slow
def test_tampered_checkpoint_is_refused_before_dcp_reads_it(gpt_run, tmp_path):
    from orch.launchers.manifest import write_manifest

    out, _ = gpt_run
    tag = "step_000000006"
    changed, planted = tmp_path / "changed", tmp_path / "planted"
    for root in (changed, planted):
        shutil.copytree(out / "checkpoints" / tag, root / tag)
    shard = changed / tag / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    # A metadata file that would run code, with a manifest rewritten to match it: the digests pass,
    # the unpickler does not.
    (planted / tag / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    write_manifest(planted / tag)
    found = _spawn("refuse", 1, out, model="gpt", tag=tag, roots=[str(changed), str(planted)])
    assert found[str(changed)]["refused"] == "CheckpointIntegrityError"
    assert f"{shard} does not match its digest" in found[str(changed)]["message"]
    assert found[str(planted)]["refused"] == "UnsafeCheckpointError"
    assert "names posix.system" in found[str(planted)]["message"]


@pytest.mark.slow
def test_hf_llama_at_tp2_uses_its_own_tp_plan_and_resumes_at_tp1(tmp_path):
    """dp=1 x tp=2 in fp32, blocks kept gathered after forward and checkpointed through the model's
    own switch: the sharded model's first loss is the unsharded one's, to fp32 rounding; its
    checkpoint loads into one unsharded rank. A large gradient, its DTensors on two meshes (the
    sharded layers' (dp, tp) and the replicated ones' dp), is clipped to exactly the global norm asked.
    Its output head shares the token embedding's weight (``tie_word_embeddings``) and is split over
    the vocabulary with it (``plan.loss_parallel``), still one parameter while it trains (the head
    and the embedding come out equal): the loss, the eval loss and the checkpoint are the unsharded
    model's all the same. (An untied head split: tests/test_fsdp2_e2e.py, through Ray.)"""
    found = _spawn("train_and_save", 2, tmp_path, model="llama_tied", tp=2, precision="fp32", reshard=False,
                   checkpointing=True, check_clip=True)
    assert found["built"].endswith(", the output head split over the vocabulary with its tied embedding "
                                   "model.embed_tokens (loss parallel, lm_head)")
    before, after = found["clipped"]
    assert before > 5 and after == pytest.approx(0.5, rel=1e-4)
    resumed = _spawn("resume", 1, tmp_path, model="llama_tied", precision="fp32")
    assert resumed["weights_equal"] and resumed["step"] == 6
    assert resumed["eval"]["loss"] == pytest.approx(found["eval"]["loss"], rel=1e-5)
    assert found["params_on_rank"] < found["params_at_build"]
    assert found["losses"][0] == pytest.approx(found["whole_first_loss"], rel=1e-5)
    assert found["losses"][-1] < found["losses"][0] - 0.5
    assert found["head_is_embedding"] and found["consolidated_shapes"] == found["whole_shapes"]
    assert all(math.isfinite(loss) for loss in found["losses"])


@pytest.mark.slow
def test_builtin_gpt_at_tp2_with_sequence_parallelism_resumes_at_tp1(tmp_path):
    """The built-in GPT's fused qkv split by DTensor's column-wise style (its rows are whole heads
    in order), the residual stream split along the sequence, and its tied head split over the
    vocabulary with the token embedding: the sharded model's first loss is the unsharded one's, to
    fp32 rounding, and its checkpoint loads into one unsharded rank."""
    found = _spawn("train_and_save", 2, tmp_path, model="gpt", tp=2, precision="fp32", sequence_parallel=True)
    assert found["built"].endswith(", the sequence split over the 2 tensor-parallel ranks, the output head split "
                                   "over the vocabulary with its tied embedding embed.wte (loss parallel, lm_head)")
    assert found["losses"][0] == pytest.approx(found["whole_first_loss"], rel=1e-5)
    assert found["losses"][-1] < found["losses"][0] - 0.5
    assert found["params_on_rank"] < found["params_at_build"]
    assert found["consolidated_shapes"] == found["whole_shapes"]
    resumed = _spawn("resume", 1, tmp_path, model="gpt", precision="fp32")
    assert resumed["weights_equal"] and resumed["step"] == 6
    assert resumed["eval"]["loss"] == pytest.approx(found["eval"]["loss"], rel=1e-5)


@pytest.mark.slow
def test_torchvision_vit_trains_in_fp16_with_checkpointed_blocks_hybrid_and_offloaded(tmp_path):
    """Two one-worker "nodes" (LOCAL_WORLD_SIZE=1): hybrid sharding shards over one rank and
    replicates over two, so each rank holds every parameter; parameters offloaded to the host;
    fp16 with dynamic loss scaling (bf16 is the GPT's test)."""
    found = _spawn("train_and_save", 2, tmp_path, model="vit", checkpointing=True, hybrid=True, offload=True,
                   node_size=1, precision="fp16")
    assert found["params_on_rank"] == found["params_at_build"]
    assert found["losses"][0] == pytest.approx(found["whole_first_loss"], rel=5e-3)
    assert found["losses"][-1] < found["losses"][0] - 0.3
    assert found["consolidated_shapes"] == found["whole_shapes"]
