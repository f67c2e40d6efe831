"""`orch train plan.engine=fsdp2`: PyTorch FSDP2 in the real 2-worker Ray actors, tracked in MLflow.

The engine on its own (tampered checkpoints, hybrid sharding, CPU offload, fp16) is tested in
tests/test_fsdp2_engine.py; here the whole run: plan, workers, checkpoints, resume, tracking.
"""

from __future__ import annotations

import io

import pytest
import torch
from mlflow.tracking import MlflowClient

from helpers.config import FAST, compose_config
from helpers.orch_command import orch_run
from orch.config import to_typed
from orch.launchers.checkpoint import latest
from orch.run.driver import run_training

pytestmark = pytest.mark.slow


def train(sqlite_uri: str, *overrides: str, stream=None, on_report=None):
    cfg = compose_config(*FAST, f"tracking.uri={sqlite_uri}", "plan.engine=fsdp2", *overrides)
    return run_training(*to_typed(cfg), stream=stream, on_report=on_report)


def test_fsdp2_follows_the_deepspeed_curve_and_resumes_at_another_dp(dp_reference, local_ray, sqlite_uri, tmp_path,
                                                                     monkeypatch):
    """The same GPT, data order, optimizer and schedule in fp32 as the ZeRO-1 reference: FSDP2's
    losses follow it. Checkpointed at dp=2 through torch.distributed.checkpoint, the run resumes at
    dp=1 (same global batch through accumulation) from the exact step, with no conversion: DCP
    reshards as it loads. Resumed with background saves, its worker is killed after step 20's began
    and before it was published: the restart resumes step 10's, the last complete one."""
    import os
    import signal

    from orch.launchers import worker_group

    checkpoints = ["train.checkpoint_every=10", f"train.checkpoint_dir={tmp_path / 'ckpt'}", "train.resume=auto"]
    first = train(sqlite_uri, *checkpoints, "plan.dp=2", "plan.precision=fp32", "train.steps=10",
                  "train.memory_probe_detail=true")
    assert [r[0].step for r in first.reports] == [5, 10]
    # What was alive at each rank's peak (train.memory_probe_detail), reported once: FSDP2's
    # gathered blocks are storages it resizes back from their freed state (named by the resize_),
    # the sharded parameters are DTensors' local shards.
    for report in first.reports[0]:
        assert sum(entry["bytes"] for entry in report.memory_at_peak) == report.measured_peak_bytes
        what = [entry["what"] for entry in report.memory_at_peak]
        assert "parameters" in what and any(": resize_" in w for w in what), what
    assert all(report.memory_at_peak is None for report in first.reports[1])
    assert [r[0].loss for r in first.reports] == pytest.approx([r[0].loss for r in dp_reference.reports[:2]],
                                                                  abs=2e-3)
    assert all(f.model.optimizer.startswith("torch.AdamW") for f in first.worker_facts)
    # Each rank held only its shard of the model after building it.
    assert all(f.model.params_on_rank < first.model.param_count for f in first.worker_facts)
    out = io.StringIO()
    # Resumed with checkpoints written in the background (DCP's async_save): step 20's is written
    # while steps 21-30 train, and published when step 30's (the last, written at once) begins. The
    # driver sees step 20's report a poll (0.05 s here) after the save began: the worker, killed
    # then, is a few steps past it at most, far from step 30.
    monkeypatch.setattr(worker_group, "POLL_INTERVAL_S", 0.05)
    killed = []

    def kill_during_the_background_save(reports, facts):
        if reports[0].step == 20 and not killed:
            killed.append(latest(tmp_path / "ckpt").step)
            os.kill(facts[0].pid, signal.SIGKILL)

    resumed = train(sqlite_uri, *checkpoints, "plan.dp=1", "cluster.devices_per_node=1", "plan.grad_accum_steps=2",
                    "plan.precision=fp32", "train.async_checkpoint=true", "train.max_failures=1", stream=out,
                    on_report=kill_during_the_background_save)
    assert killed == [10]  # step 20's checkpoint was not published when the worker died
    assert "universal" not in out.getvalue() and "resuming from step 10" in out.getvalue()
    from orch.launchers.manifest import verify

    for step in (20, 30):  # both whole: every file the manifest lists, byte for byte, nothing else
        assert verify(tmp_path / "ckpt" / f"step_{step:09d}").files
    assert resumed.goodput["total"]["checkpoint"] > 0
    assert resumed.run_id == first.run_id and resumed.worker_facts[0].start_step == 10
    assert [r[0].step for r in resumed.reports] == [15, 20, 15, 20, 25, 30]  # 15 and 20 trained again
    assert [r[0].loss for r in resumed.reports[2:]] == pytest.approx([r[0].loss for r in dp_reference.reports[2:]],
                                                                        abs=5e-3)
    client = MlflowClient(tracking_uri=sqlite_uri)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.params["plan.engine"] == "fsdp2"
    assert run.data.tags["restart.1.resumed_from_step"] == "10"
    # The engine-neutral optimizer settings are logged; no DeepSpeed JSON, which FSDP2 never reads.
    assert {a.path for a in client.list_artifacts(first.run_id, "config")} == {
        "config/resolved.yaml", "config/optimizer.json"}
    import json

    with open(client.download_artifacts(first.run_id, "config/optimizer.json")) as f:
        optim = json.load(f)
    assert optim["optimizer"]["name"] == "adamw" and optim["schedule"]["total_num_steps"] == 10
    # Measured against predicted memory, logged as for DeepSpeed runs.
    assert any(name.startswith("memory") for name in run.data.metrics), sorted(run.data.metrics)
    # `orch export` joins the newest checkpoint's shards (DCP, in one process) into the model's weights,
    # the ones the run itself logged at its end.
    from safetensors.torch import load_file

    from orch.export import export_run

    assert export_run(sqlite_uri, resumed.run_id, to_typed(compose_config())[1], tmp_path / "out") == "step_000000030"
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert exported and all(t.dtype == torch.float32 for t in exported.values())
    # A shard cut short, its manifest rewritten to match (as whoever can write the directory can):
    # `orch export` names the file and exits 2, with the error as a JSON document under --json.

    from orch.launchers.manifest import read_manifest, write_manifest

    newest = tmp_path / "ckpt" / "step_000000030"
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:64])
    recorded = read_manifest(newest)
    write_manifest(newest, layout=recorded.layout, model=recorded.model)
    done = orch_run(["export", resumed.run_id, "--out", "bad", "--json",
                     f"tracking.uri={sqlite_uri}"], cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"checkpoint file {shard} is cut short: 64 bytes" in json.loads(done.stdout)["error"]["message"]
    assert "Traceback" not in done.stderr and f"{shard} is cut short" in done.stderr
    # A DeepSpeed run cannot take the FSDP2 checkpoint: refused before any worker starts.
    from orch.plans.errors import PlanError

    with pytest.raises(PlanError, match=r"plan.engine.*written by the fsdp2 engine"):
        run_training(*to_typed(compose_config(*FAST, f"tracking.uri={sqlite_uri}", *checkpoints, "plan.dp=2",
                                              "train.steps=40")))


def test_fsdp2_trains_an_hf_llama_with_tensor_parallelism_in_bf16(local_ray, sqlite_uri):
    """The Hugging Face Llama shape on a (dp=1, tp=2) mesh: DTensor shards its layers by the
    model's own tensor-parallel plan and its tied head with the embedding over the vocabulary,
    FSDP2 wraps each decoder layer, bf16 mixed precision, and
    selective recomputation through the model's own switch (``gradient_checkpointing_kwargs``).
    Step 12 runs under the profiler: the tensor-parallel all-reduces show as communication."""
    out = io.StringIO()
    result = train(sqlite_uri, "model=hf_causal_lm", "plan.tp=2", "plan.precision=bf16",
                   "plan.activation_checkpointing=selective", "train.profile_steps=[12]", stream=out)
    first, last = result.reports[0], result.reports[-1]
    assert last[0].loss < first[0].loss - 0.5, (first[0].loss, last[0].loss)
    # Both ranks of the tensor-parallel group read the same batch and hold half of the sharded layers.
    assert first[0].first_batch_digest == first[1].first_batch_digest
    assert all(f.model.params_on_rank < result.model.param_count for f in result.worker_facts)
    # Its head shares the token embedding's weight (tie_word_embeddings): split over the vocabulary with it.
    assert all(f.model.built.endswith(", the output head split over the vocabulary with its tied embedding "
                                      "model.embed_tokens (loss parallel, lm_head)") for f in result.worker_facts)
    profiled = next(reports for reports in result.reports if reports[0].step == 15)
    for report in profiled:
        profile, = report.profiles
        for kind in ("matmul", "attention", "communication", "optimizer"):
            assert profile.seconds.get(kind, 0) > 0, (report.rank, kind, profile.seconds)
    assert "profile: step 12 profiled (operator CPU time" in out.getvalue()
    assert "profile: traces of step 12 in the MLflow run under profile/step12/" in out.getvalue()


def test_the_vit_fsdp_recipe_trains_a_torchvision_model(local_ray, sqlite_uri):
    result = run_training(*to_typed(compose_config("experiment=vit_fsdp_bf16", "train.steps=20",
                                                   f"tracking.uri={sqlite_uri}")))
    first, last = result.reports[0], result.reports[-1]
    assert last[0].loss < first[0].loss, (first[0].loss, last[0].loss)
    assert last[0].evaluation["eval_accuracy"] > 0.1


def test_fsdp2_compiles_each_block_and_follows_the_same_curve(dp_reference, local_ray, sqlite_uri):
    """``plan.compile=true``: each GPT block is compiled (torch.compile, inductor's C++ kernels on
    CPU) before fully_shard wraps it; the losses follow the ZeRO-1 reference as the eager run's do.
    The two ranks split each sequence (``plan.cp=2``, the global batch kept through accumulation):
    the compiled blocks run the context-parallel attention, and FSDP2 shards over both ranks."""
    result = train(sqlite_uri, "plan.dp=1", "plan.cp=2", "plan.grad_accum_steps=2", "plan.precision=fp32",
                   "plan.compile=true", "train.steps=10", "train.export=false")
    assert all("each block compiled (torch.compile)" in f.model.built
               and "each sample's sequence split over 2 context-parallel ranks" in f.model.built
               for f in result.worker_facts)
    assert [r[0].loss for r in result.reports] == pytest.approx([r[0].loss for r in dp_reference.reports[:2]],
                                                                  abs=2e-3)


def test_sequence_and_context_parallelism_follow_the_whole_sequence_curve(local_ray, sqlite_uri, tmp_path):
    """On the Hugging Face Llama shape (grouped-query attention) with an untied head, in fp32, beside
    one tp=2 run whose ranks each see the whole sequence and split the head over the vocabulary
    (``plan.loss_parallel``, on by default):

    - ``plan.sequence_parallel=true`` at tp=2: the norms and residual adds run on half the sequence
      each (DTensor's ``SequenceParallel``, the row-parallel layers reduce-scattering); the losses
      are tensor parallelism's alone, and the plan is tracked;
    - ``plan.cp=2``: each rank runs the model on half of every sequence (head-tail chunks, keys and
      values gathered for attention); the losses and eval loss are the whole sequence's, alone and
      with tp=2 and the sequence split on 4 workers, and its DCP checkpoint resumes at tp=2 (cp=1)
      and goes on along the same curve.

    The cp=2 run keeps the head whole (tp=1): its losses equal the split head's, and its checkpoint
    resumes split.
    """
    common = ("model=hf_causal_lm", "model.config.tie_word_embeddings=false", "plan.dp=1", "plan.precision=fp32",
              "train.export=false", "train.eval_every=10")
    split_head = ", the output head split over the vocabulary (loss parallel, lm_head)"
    whole = train(sqlite_uri, *common, "plan.tp=2", "train.steps=20")
    losses = [r[0].loss for r in whole.reports]
    evals = [whole.reports[i][0].evaluation["eval_loss"] for i in (1, 3)]
    assert not any("sequence split" in f.model.built for f in whole.worker_facts)
    assert all(f.model.built.endswith(split_head) for f in whole.worker_facts)

    sequence = train(sqlite_uri, *common, "plan.tp=2", "plan.sequence_parallel=true", "train.steps=10")
    assert all("the sequence split over the 2 tensor-parallel ranks" in f.model.built
               for f in sequence.worker_facts)
    assert [r[0].loss for r in sequence.reports] == pytest.approx(losses[:2], rel=1e-5)
    assert sequence.reports[-1][0].evaluation["eval_loss"] == pytest.approx(evals[0], rel=1e-5)
    params = MlflowClient(sqlite_uri).get_run(sequence.run_id).data.params
    assert params["plan.sequence_parallel"] == "True"

    checkpoints = (f"train.checkpoint_dir={tmp_path / 'ckpt'}", "train.checkpoint_every=10", "train.resume=auto")
    context = train(sqlite_uri, *common, "plan.cp=2", "train.steps=10", *checkpoints)
    assert all("each sample's sequence split over 2 context-parallel ranks" in f.model.built
               and split_head not in f.model.built for f in context.worker_facts)
    assert [r[0].loss for r in context.reports] == pytest.approx(losses[:2], rel=1e-4)
    assert context.reports[-1][0].evaluation["eval_loss"] == pytest.approx(evals[0], rel=1e-4)
    assert MlflowClient(sqlite_uri).get_run(context.run_id).data.params["plan.cp"] == "2"
    # Resumed before the 4-worker run: it takes the 2 workers of the run before it.
    resumed = train(sqlite_uri, *common, "plan.tp=2", "train.steps=20", *checkpoints)
    assert resumed.run_id == context.run_id and resumed.worker_facts[0].start_step == 10
    assert [r[0].loss for r in resumed.reports] == pytest.approx(losses[2:], rel=1e-4)
    assert resumed.reports[-1][0].evaluation["eval_loss"] == pytest.approx(evals[1], rel=1e-4)
    # All three on 4 workers: FSDP2 over the flattened (dp, cp) mesh dimension, tp inside each cp rank.
    four = train(sqlite_uri, *common, "plan.tp=2", "plan.cp=2", "plan.sequence_parallel=true", "train.steps=10",
                 "cluster.devices_per_node=4", "cluster.cpus_per_worker=0.5")
    assert all(f.model.built.endswith(split_head) for f in four.worker_facts)
    assert [r[0].loss for r in four.reports] == pytest.approx(losses[:2], rel=1e-4)
    assert four.reports[-1][0].evaluation["eval_loss"] == pytest.approx(evals[0], rel=1e-4)
