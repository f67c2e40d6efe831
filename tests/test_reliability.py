"""Checkpoints, resume and automatic restart, with real workers killed for real."""

from __future__ import annotations

import enum
import io
import json
import os
import pickle
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from helpers.config import compose_config
from orch.config import to_typed
from orch.launchers.checkpoint import LATEST, latest, publish, tag_for
from orch.run.driver import run_training

RUN = ["train.steps=30", "train.log_every=5", "train.eval_batches=1", "plan.micro_batch_size=4",
       "plan.zero_stage=1", "train.checkpoint_every=10"]


def test_the_process_group_outlasts_the_hang_detector():
    from orch.launchers.worker_group import collective_timeout_env

    # DeepSpeed's default (10 min) is shorter than train.hang_timeout_s's default (900 s).
    assert collective_timeout_env(900) == {"DEEPSPEED_TIMEOUT": "25"}
    assert int(collective_timeout_env(3601)["DEEPSPEED_TIMEOUT"]) * 60 > 3601
    assert collective_timeout_env(0) == {}  # detection off: the process group's timeout is the guard
    # A rank waiting in setup's collectives for a stuck peer outlasts train.setup_timeout_s too.
    assert collective_timeout_env(900, 1800) == {"DEEPSPEED_TIMEOUT": "40"}


def test_publish_is_atomic_and_prunes(tmp_path):
    for step in (10, 20, 30):
        (tmp_path / tag_for(step)).mkdir()
        publish(tmp_path, step, "run-1", keep=2)
    record = latest(tmp_path)
    assert record.step == 30 and record.tags == [tag_for(20), tag_for(30)] and record.run_id == "run-1"
    assert not (tmp_path / tag_for(10)).exists() and (tmp_path / tag_for(20)).exists()
    # An interrupted save leaves a half-written tag directory and maybe a temp file: neither counts.
    (tmp_path / tag_for(40)).mkdir()
    (tmp_path / ".latest.json.crashed.partial").write_text("{")
    assert latest(tmp_path).step == 30
    assert sorted(p.name for p in tmp_path.iterdir() if p.name == LATEST) == [LATEST]


@pytest.mark.slow
def test_killed_workers_restart_from_the_checkpoint_even_after_the_last_one(local_ray, sqlite_uri, tmp_path,
                                                                            monkeypatch, capsys):
    """Rank 1 is killed (a real kill -9) twice in one run, its checkpoints written in the background
    (``train.async_checkpoint``). First at step 25, after step 20's checkpoint began and before it
    was published (at step 30's): the group restarts from step 10's, the last published, and
    replays the same losses. Then once step 30's checkpoint, the
    last, is published, while the final evaluation runs: the third attempt has no step left, and
    still ends the run with the last step's report (the checkpointed loss) and its evaluation. It
    used to run nothing and report nothing.

    The run is tracked where tracking.fallback=local sends it when its tracking server does not
    answer: a local store in the working directory (tmp_path, where ``sqlite_uri`` runs the test)."""
    import threading
    import time

    from helpers.processes import free_port
    from orch.launchers import worker_group

    # The first kill must land between the checkpoints of steps 20 and 30. The driver sees step 25
    # up to one poll late, and these steps take a few hundredths of a second: at the default
    # half-second poll the workers can already be past step 20.
    monkeypatch.setattr(worker_group, "POLL_INTERVAL_S", 0.05)
    ckpt, killed, facts_seen = tmp_path / "ckpt", [], []

    def kill_rank1_at_step_25(reports, facts):
        facts_seen.append(facts)
        if reports[0].step == 25 and not killed:
            os.kill(facts[1].pid, signal.SIGKILL)
            killed.append(facts[1].pid)

    def kill_rank1_when_the_last_checkpoint_is_published() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(killed) < 2:
            published = latest(ckpt) if ckpt.exists() else None
            if published is not None and published.step == 30 and killed:
                os.kill(facts_seen[-1][1].pid, signal.SIGKILL)  # the second attempt's rank 1
                killed.append(facts_seen[-1][1].pid)
            time.sleep(0.005)

    # A long final evaluation keeps rank 1 busy between the last checkpoint and the final report.
    cfg = compose_config(*RUN, "train.eval_batches=40", f"train.checkpoint_dir={ckpt}", "train.max_failures=2",
                         "train.async_checkpoint=true",
                         f"tracking.uri=http://127.0.0.1:{free_port()}", "tracking.fallback=local",
                         "tracking.run_name=killed")
    watcher = threading.Thread(target=kill_rank1_when_the_last_checkpoint_is_published, daemon=True)
    watcher.start()
    result = run_training(*to_typed(cfg), on_report=kill_rank1_at_step_25)
    watcher.join(timeout=1)
    assert "tracking in sqlite:///mlflow.db instead" in capsys.readouterr().err
    assert len(killed) == 2, f"killed {killed}: the last checkpoint was never seen published"
    steps = [r[0].step for r in result.reports]
    # First attempt: 5 to 25 (killed after 25's report); the second resumes at 10 (step 20's
    # checkpoint was written but never published) and is killed during the final evaluation,
    # before step 30's report; the third resumes at 30 and reports it.
    assert steps == [5, 10, 15, 20, 25, 15, 20, 25, 30]
    # Same weights, optimizer, scheduler, data position and RNG: the replayed intervals compute
    # the same losses. Only the order of floating-point reductions could differ (it does not on
    # this 2-rank gloo group), hence a tolerance far below any real drift.
    for first, replayed in zip(result.reports[2:5], result.reports[5:8], strict=True):
        assert replayed[0].loss == pytest.approx(first[0].loss, abs=1e-4)
    assert result.worker_facts[1].pid not in killed
    assert result.worker_facts[0].start_step == 30  # the third attempt had nothing left to train
    final = result.reports[-1][0]
    assert final.evaluation["eval_loss"] > 0 and 0 < final.loss < result.reports[0][0].loss
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")  # where the fallback tracked it
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["restarts"] == "2" and run.data.tags["restart.1.resumed_from_step"] == "10"
    assert run.data.tags["restart.2.resumed_from_step"] == "30"
    assert "ActorDiedError" in run.data.tags["restart.1.cause"] or "died" in run.data.tags["restart.1.cause"]
    assert [m.step for m in client.get_metric_history(result.run_id, "loss")] == [5, 10, 15, 20, 25, 30]
    assert [m.step for m in client.get_metric_history(result.run_id, "eval_loss")] == [30]
    assert latest(ckpt).step == 30
    # Goodput: the two failures, the replayed steps 11-15, the checkpoints and the final evaluation
    # each took their share of the wall time, and the shares add up to it.
    goodput = result.goodput
    total, attempts = goodput["total"], goodput["attempts"]
    assert [a["failed"] is not None for a in attempts] == [True, True, False]
    assert all(a["seconds"]["restart"] > 0 for a in attempts[:2]) and attempts[2]["seconds"]["restart"] == 0
    assert attempts[1]["seconds"]["redone"] > 0 and attempts[0]["seconds"]["redone"] == 0
    assert total["checkpoint"] > 0 and attempts[2]["seconds"]["evaluation"] > 0 and total["startup"] > 0
    kinds = ("training", "startup", "checkpoint", "evaluation", "restart", "redone", "other")
    assert sum(total[kind] for kind in kinds) == pytest.approx(total["wall"])
    assert 0 < total["goodput"] < 1 and total["goodput"] == pytest.approx(total["training"] / total["wall"])
    assert run.data.metrics["goodput"] == pytest.approx(total["goodput"])
    assert run.data.metrics["goodput/restart_s"] == pytest.approx(total["restart"])
    assert "goodput.json" in {a.path for a in client.list_artifacts(result.run_id)}


def tracked_hang(sqlite_uri: str, run_name: str) -> tuple[str, str, set[str]]:
    """What the MLflow run of a hung run kept: its status, the ranks its first hang named, the stacks saved."""
    client = MlflowClient(tracking_uri=sqlite_uri)
    run = client.search_runs([client.get_experiment_by_name("orch").experiment_id],
                             filter_string=f"attributes.run_name = '{run_name}'")[0]
    saved = {a.path for a in client.list_artifacts(run.info.run_id, "hangs/attempt1")}
    return run.info.status, run.data.tags["hang.1.ranks"], saved


@pytest.mark.slow
def test_a_worker_stuck_in_setup_is_stopped_and_its_stacks_saved(local_ray, sqlite_uri):
    from deepspeed.comm.torch import build_shm_op

    from orch.launchers.worker_group import WorkerHangError

    # The workers' first DeepSpeed call builds its shared-memory comm op unless the cache holds it
    # for this checkout: ~30 s, which would count against the short limit below. Built here first.
    assert build_shm_op() is not None
    # Rank 1 never finishes building its model; rank 0 waits for it in DeepSpeed's first collective.
    cfg = compose_config(*RUN, "train.checkpoint_every=0", "model._target_=faulty_models.SetupHangingGPT",
                         "train.setup_timeout_s=15", f"tracking.uri={sqlite_uri}", "tracking.run_name=stuck")
    with pytest.raises(WorkerHangError) as info:
        run_training(*to_typed(cfg))
    assert info.value.ranks == [0, 1]  # rank 0 is still in setup too, waiting for rank 1
    assert "setup (process group, model, DeepSpeed engine) unfinished after 15s" in str(info.value)
    assert "time.sleep(3600)" in info.value.stacks[1]
    assert tracked_hang(sqlite_uri, "stuck") == ("FAILED", "0,1",
                                                 {"hangs/attempt1/rank0.txt", "hangs/attempt1/rank1.txt"})


@pytest.mark.slow
def test_a_rank_failing_in_setup_fails_the_run_without_waiting_for_its_peers(local_ray, sqlite_uri):
    from orch.launchers.worker_group import WorkerFailedError

    # No setup limit: only the failing rank's own error can end the wait, not a timeout.
    cfg = compose_config(*RUN, "train.checkpoint_every=0", "model._target_=faulty_models.SetupFailingGPT",
                         "train.setup_timeout_s=0", f"tracking.uri={sqlite_uri}")
    with pytest.raises(WorkerFailedError) as info:
        run_training(*to_typed(cfg))
    # Which rank, in which phase, what it raised and where: the worker's own traceback, without
    # the colour codes of Ray's wrapper.
    message = str(info.value)
    assert info.value.rank == 1 and message.startswith("rank 1 failed during setup: ValueError: rank 1 cannot "
                                                       "build the model"), message
    assert "faulty_models.py" in message and "\x1b[" not in message and "RayTaskError" not in message


class _PlantedPickle:
    """Unpickling this calls ``open(path, "w")``: proof, if the file appears, that a load ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant(checkpoint: Path, marker: Path) -> list[Path]:
    """Add a code-running object to every model-states file of ``checkpoint`` (where client state lives),
    and rewrite its manifest to match, as whoever can write the directory can: the weights-only
    loader must stop the pickle on its own."""
    import torch

    from orch.launchers.manifest import read_manifest, write_manifest

    planted = sorted(checkpoint.glob("*model_states.pt"))
    for path in planted:
        state = torch.load(path, weights_only=False)  # our own file, written a moment ago
        state["planted"] = _PlantedPickle(marker)
        torch.save(state, path)
    recorded = read_manifest(checkpoint)
    write_manifest(checkpoint, layout=recorded.layout, model=recorded.model)
    assert not marker.exists()
    return planted


def test_weights_only_load_refuses_code_and_accepts_deepspeed_state(tmp_path):
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from orch.launchers.engines.deepspeed.checkpoint_files import deepspeed_checkpoint_globals
    from orch.launchers.safe_load import UnsafeCheckpointError, load_weights_only

    # What ZeRO optimizers save besides tensors (runtime/zero/stage_1_and_2.py: state_dict()).
    good = {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0),
            "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}], "t": torch.ones(2)}
    torch.save(good, tmp_path / "good.pt")
    loaded = load_weights_only(str(tmp_path / "good.pt"), deepspeed_checkpoint_globals())
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and loaded["loss_scaler"].cur_scale == 1.0
    assert loaded["param_slice_mappings"][0]["w"] == fragment_address(numel=4, start=0)

    marker = tmp_path / "code-ran"
    torch.save({**good, "planted": _PlantedPickle(marker)}, tmp_path / "bad.pt")
    with pytest.raises(UnsafeCheckpointError) as info:
        load_weights_only(str(tmp_path / "bad.pt"), deepspeed_checkpoint_globals())
    assert f"checkpoint file {tmp_path / 'bad.pt'} holds pickled objects that could run code" in str(info.value)
    assert "io.open" in str(info.value) and "It was not loaded" in str(info.value)
    assert not marker.exists()


class _GetattrPickler(pickle.Pickler):
    """Pickles every Enum member as ``getattr(its class, NAME)``, as Python 3.11.0-3.11.3 (Debian 12's
    3.11.2) pickle the members of an Enum with a mixed-in type; ``NAME`` may be replaced to forge one."""

    name_of = staticmethod(lambda member: member.name)

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), self.name_of(obj))
        return NotImplemented


def test_an_enum_member_pickled_by_name_loads_and_no_other_getattr_does(tmp_path):
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from orch.launchers.engines.deepspeed.checkpoint_files import deepspeed_checkpoint_globals
    from orch.launchers.safe_load import UnsafeCheckpointError, load_weights_only

    def save(obj, name: str, member_name=lambda member: member.name) -> str:
        pickler = type("Pickler", (_GetattrPickler,), {"name_of": staticmethod(member_name)})
        torch.save(obj, tmp_path / name, pickle_module=SimpleNamespace(__name__="pickle_3_11_2", Pickler=pickler))
        assert b"getattr" in (tmp_path / name).read_bytes()
        return str(tmp_path / name)

    # A ZeRO optimizer's state as that Python writes it: read back, the member itself.
    loaded = load_weights_only(save({"zero_stage": ZeroStageEnum.gradients, "t": torch.ones(2)}, "3.11.2.pt"),
                               deepspeed_checkpoint_globals())
    assert loaded["zero_stage"] is ZeroStageEnum.gradients
    # getattr for anything but an allowed Enum's member is refused, nothing called.
    for name, forged in (("attribute.pt", lambda member: "__init__"), ("missing.pt", lambda member: "nope")):
        with pytest.raises(UnsafeCheckpointError, match=re.escape(str(tmp_path / name))):
            load_weights_only(save({"zero_stage": ZeroStageEnum.gradients}, name, forged),
                              deepspeed_checkpoint_globals())

    class NotAnEnum(pickle.Pickler):  # getattr of an allowed class that is no Enum
        def reducer_override(self, obj):
            return (getattr, (LossScaler, "__init__")) if isinstance(obj, LossScaler) else NotImplemented

    torch.save({"k": LossScaler(1.0)}, tmp_path / "scaler.pt",
               pickle_module=SimpleNamespace(__name__="p", Pickler=NotAnEnum))
    with pytest.raises(UnsafeCheckpointError, match="scaler.pt"):
        load_weights_only(str(tmp_path / "scaler.pt"), deepspeed_checkpoint_globals())


def test_latest_json_cannot_point_outside_the_checkpoint_dir(tmp_path):
    from orch.launchers.checkpoint import CheckpointRecordError

    victim = tmp_path / "victim"
    victim.mkdir()
    root = tmp_path / "ckpt"
    root.mkdir()
    for tag, tags, run_id, named in [("../victim", ["../victim"], "run1", "tag='../victim'"),
                                     (tag_for(10), ["/tmp", tag_for(10)], "run1", "tag='/tmp'"),
                                     (tag_for(10), [tag_for(10)], "../../run", "run_id='../../run'")]:
        (root / LATEST).write_text(json.dumps({"tag": tag, "step": 10, "run_id": run_id, "tags": tags}))
        with pytest.raises(CheckpointRecordError, match=re.escape(named)):
            latest(root)
        # Publishing reads the record to prune old tags: it must refuse before deleting anything.
        with pytest.raises(CheckpointRecordError):
            publish(root, 20, "run1", keep=1)
        assert victim.exists()


@pytest.mark.slow
# Stage 3 splits model and optimizer states per rank, so a pickle is planted there (in every
# model file). Stages 0 and 1 are resumed through the same loader by the tests above.
@pytest.mark.parametrize("stage, plant", [(3, True)], ids=["zero3-planted"])
def test_resume_loads_weights_only_and_refuses_a_planted_pickle(local_ray, tmp_path, stage, plant):
    from orch.launchers.safe_load import UnsafeCheckpointError

    ckpt = tmp_path / "ckpt"
    run = ["train.steps=6", "train.log_every=2", "train.eval_batches=1", "plan.micro_batch_size=2",
           "train.checkpoint_every=4", f"plan.zero_stage={stage}", f"train.checkpoint_dir={ckpt}",
           "tracking.enabled=false"]
    first = run_training(*to_typed(compose_config(*run)))
    assert all(f.model.built == "zero.Init" for f in first.worker_facts)  # stage 3: no rank held the whole model
    # Point latest.json back at step 4 (as a crash after it would), so the resume replays 5-6.
    publish(ckpt, 4, None, keep=2)
    resumed = run_training(*to_typed(compose_config(*run, "train.resume=auto")))
    assert resumed.worker_facts[0].start_step == 4 and [r[0].step for r in resumed.reports] == [6]
    # Model, optimizer, scheduler, data position and RNG came back through the weights-only
    # loader: the replayed steps compute what the first run computed (same tolerance as above).
    assert resumed.reports[0][0].loss == pytest.approx(first.reports[-1][0].loss, abs=1e-4)

    if not plant:
        return
    marker = tmp_path / "code-ran"
    planted = _plant(ckpt / latest(ckpt).tag, marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        run_training(*to_typed(compose_config(*run, "train.resume=auto")))
    # The worker's own message, not buried under Ray's remote traceback.
    assert str(info.value).startswith("checkpoint file ")
    assert "holds pickled objects that could run code when loaded: io.open" in str(info.value)
    assert any(str(path) in str(info.value) for path in planted)
    assert not marker.exists()


@pytest.mark.slow
def test_a_hang_inside_a_collective_is_detected_and_nothing_is_left(local_ray, sqlite_uri):
    import time

    import ray

    from helpers.processes import alive
    from orch.launchers.worker_group import WorkerHangError

    timeout_s = 5
    cfg = compose_config(*RUN, "train.log_every=1", "train.checkpoint_every=0", f"train.hang_timeout_s={timeout_s}",
                         "model._target_=faulty_models.CollectiveStallGPT", f"tracking.uri={sqlite_uri}",
                         "tracking.run_name=collective")
    seen: dict = {}

    def remember(reports, facts):
        seen.update(pids={f.pid for f in facts}, step=reports[0].step, at=time.monotonic())
        with open(f"/proc/{facts[0].pid}/environ") as f:  # what DeepSpeed read its timeout from
            seen["env"] = dict(v.split("=", 1) for v in f.read().split("\0") if "=" in v)

    class Terminal(io.StringIO):
        """The driver's output, noting when it announces the hang (before it tears the group down)."""

        def write(self, text: str) -> int:
            if text.startswith("hang: "):
                seen.setdefault("hang_at", time.monotonic())
            return super().write(text)

    with pytest.raises(WorkerHangError) as info:
        run_training(*to_typed(cfg), on_report=remember, stream=Terminal())
    detected_after = seen["hang_at"] - seen["at"]
    # Steps 1-3 finished; rank 1 entered its stray all-reduce in step 4's forward pass, and rank 0
    # the gradient all-reduce of step 4's backward: rank 1 is the one behind.
    assert seen["step"] == 3 and info.value.ranks == [1]
    assert f"rank(s) 1 stopped reporting: no optimizer step for {timeout_s}s" in str(info.value)
    # Detected once the timeout passed, plus polling and collecting the stacks, far before gloo's
    # own timeout (DEEPSPEED_TIMEOUT, raised above the hang timeout) would have ended it.
    assert timeout_s - 1 < detected_after < timeout_s + 15, detected_after
    # Minutes: the longer of the hang timeout (5 s) and train.setup_timeout_s (1800 s), + DeepSpeed's 10.
    assert seen["env"]["DEEPSPEED_TIMEOUT"] == "40"
    assert "all_reduce(torch.ones(1), group=self.side_group)" in info.value.stacks[1]
    assert "all_reduce" in info.value.stacks[0] and "backward" in info.value.stacks[0]
    client = MlflowClient(tracking_uri=sqlite_uri)
    run = client.search_runs([client.get_experiment_by_name("orch").experiment_id],
                             filter_string="attributes.run_name = 'collective'")[0]
    assert run.info.status == "FAILED" and run.data.tags["hang.1.ranks"] == "1"
    saved = {a.path for a in client.list_artifacts(run.info.run_id, "hangs/attempt1")}
    assert saved == {"hangs/attempt1/rank0.txt", "hangs/attempt1/rank1.txt"}
    # No worker process survives, although both were stuck inside gloo, and nothing stays reserved.
    deadline = time.monotonic() + 30
    while alive(seen["pids"]) or ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, f"left behind: processes {alive(seen['pids'])}"
        time.sleep(0.5)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.mark.slow
def test_a_resume_verifies_its_checkpoint_and_falls_back(local_ray, sqlite_uri, tmp_path, capsys):
    """A dp=2 ZeRO-1 run writes steps 2 and 4; a legacy pickle then replaces an optimizer shard of
    step 4. The attacks are checked on these real files first, without Ray; then a resume at dp=1
    (which would go through DeepSpeed's converter) skips step 4 before anything is unpickled,
    falls back to step 2 and finishes, leaving the first MLflow run FINISHED. A model change, a
    directory held by another run and a directory with no intact checkpoint are refused before
    any worker starts."""
    import shutil

    import torch

    from orch.launchers.checkpoint import CheckpointDirBusyError, NoIntactCheckpointError, directory_lock
    from orch.launchers.engines.deepspeed.universal import convert
    from orch.launchers.manifest import CheckpointIntegrityError, read_manifest, verify, write_manifest
    from orch.launchers.safe_load import UnsafeCheckpointError
    from orch.plans.errors import PlanError

    ckpt = tmp_path / "ckpt"
    run = [*RUN, "train.steps=4", "train.log_every=2", "train.checkpoint_every=2", f"train.checkpoint_dir={ckpt}",
           f"tracking.uri={sqlite_uri}", "train.resume=auto"]
    at_dp1 = ["plan.dp=1", "cluster.devices_per_node=1", "plan.grad_accum_steps=2"]

    def train(*overrides, stream=None):
        return run_training(*to_typed(compose_config(*run, *overrides)), stream=stream)

    first = train("plan.dp=2")
    older, newest = ckpt / tag_for(2), ckpt / tag_for(4)
    shard = newest / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    marker = tmp_path / "code-ran"
    torch.save({"planted": _PlantedPickle(marker)}, shard, _use_new_zipfile_serialization=False)

    # The attacks on the real files, no Ray needed: each is refused naming the file.
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"checkpoint file {shard} does not match")):
        verify(newest)
    forged = tmp_path / "forged"
    shutil.copytree(ckpt, forged)
    recorded = read_manifest(newest)
    write_manifest(forged / newest.name, layout=recorded.layout, model=recorded.model)  # a rewritten manifest
    with pytest.raises(UnsafeCheckpointError, match=re.escape(f"checkpoint file {forged / newest.name / shard.name}")):
        convert(forged, newest.name)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        shutil.copy(older / name, forged / newest.name / name)  # swapped in from the other checkpoint
        with pytest.raises(CheckpointIntegrityError, match=re.escape(f"{forged / newest.name / name} does not match")):
            verify(forged / newest.name)
        shutil.copy(newest / name, forged / newest.name / name)
    truncated = forged / older.name / "mp_rank_00_model_states.pt"
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"{truncated} does not match")):
        verify(forged / older.name)

    # Refused before any worker starts: a model the checkpoint does not fit, a directory in use.
    with pytest.raises(PlanError) as info:
        train(*at_dp1, "model.d_model=64")
    assert [(v.field, v.value) for v in info.value.violations] == [("model.d_model", 64)]
    with directory_lock(ckpt), pytest.raises(CheckpointDirBusyError, match="is in use by another orch run"):
        train(*at_dp1)
    capsys.readouterr()

    out = io.StringIO()
    resumed = train(*at_dp1, stream=out)
    err = capsys.readouterr().err
    assert f"not resuming from {newest}: checkpoint file {shard} does not match its digest" in err
    assert f"resuming from the newest intact checkpoint, {older}" in err
    assert "written with dp=2; converting it to a universal checkpoint for dp=1" in out.getvalue()
    assert resumed.worker_facts[0].start_step == 2 and [r[0].step for r in resumed.reports] == [4]
    assert resumed.run_id == first.run_id and not marker.exists()
    verify(newest)  # written again by the resumed run, manifest and all
    verify(ckpt / f"{older.name}_universal")
    client = MlflowClient(tracking_uri=sqlite_uri)
    assert client.get_run(first.run_id).info.status == "FINISHED"

    # Nothing intact left: refused with the fix, the run's status untouched.
    for tag in (older, newest):
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"cut short")
    with pytest.raises(NoIntactCheckpointError, match="Fix: set train.resume=never"):
        train(*at_dp1)
    assert client.get_run(first.run_id).info.status == "FINISHED" and not marker.exists()
