"""Checkpoint verification in milliseconds: manifests, the weights-only check of files DeepSpeed
unpickles without it, the choice of the checkpoint to resume, the directory lock, the record in
``latest.json``, and what a resume does to the MLflow run it continues (a real sqlite store).

The same attacks on a real DeepSpeed checkpoint, and one refused resume, are in
tests/test_reliability.py (``test_a_resume_verifies_its_checkpoint_and_falls_back``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from orch.launchers.checkpoint import (
    LATEST,
    CheckpointDirBusyError,
    CheckpointDirError,
    CheckpointRecordError,
    NoIntactCheckpointError,
    directory_lock,
    latest,
    publish,
    resumable,
    tag_for,
)
from orch.launchers.engines.deepspeed.checkpoint_files import deepspeed_checkpoint_globals
from orch.launchers.manifest import MANIFEST, CheckpointIntegrityError, read_manifest, verify, write_manifest
from orch.launchers.safe_load import UnsafeCheckpointError, check_data_only, refused_globals
from orch.plans.errors import PlanError
from orch.plans.storage.locations import partial_name, write_whole

OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


class PlantedPickle:
    """Unpickling this calls ``open(path, "w")``: proof, if the file appears, that a load ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def save(obj, path: Path, *, legacy: bool = False) -> None:
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)


def written(root: Path, step: int, scale: float = 1.0, model: dict | None = None) -> Path:
    """A published tag shaped like DeepSpeed's (a model file, an optimizer shard each of 2 ranks)."""
    folder = root / tag_for(step)
    folder.mkdir(parents=True)
    save({"module": {"w": torch.full((4,), scale)}, "step": step}, folder / MODEL)
    for rank in (0, 1):
        save({"exp_avg": torch.full((2,), scale * (rank + 1))}, folder / OPTIM.replace("rank_0", f"rank_{rank}"))
    publish(root, step, "run1", keep=2, layout={"dp": 2, "tp": 1, "pp": 1, "zero_stage": 1}, model=model)
    return folder


@pytest.fixture
def two_tags(tmp_path) -> tuple[Path, Path, Path]:
    root = tmp_path / "ckpt"
    return root, written(root, 2, 1.0), written(root, 4, 2.0)


def test_an_intact_checkpoint_verifies_and_records_its_layout(two_tags):
    root, _, newest = two_tags
    manifest = verify(newest)
    assert sorted(manifest.files) == sorted([MODEL, OPTIM, OPTIM.replace("rank_0", "rank_1")])
    assert manifest.layout["dp"] == 2
    assert resumable(root, None).tag == tag_for(4)


@pytest.mark.parametrize("legacy", [True, False], ids=["legacy-pickle", "zip-pickle"])
def test_a_planted_pickle_is_refused_by_the_manifest(two_tags, legacy):
    root, _, newest = two_tags
    marker = newest / "code-ran"
    save({"exp_avg": torch.ones(2), "x": PlantedPickle(marker)}, newest / OPTIM, legacy=legacy)
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"checkpoint file {newest / OPTIM} does not match")):
        verify(newest)
    assert not marker.exists()


def test_a_truncated_file_and_a_swapped_file_are_refused(two_tags):
    root, older, newest = two_tags
    data = (newest / MODEL).read_bytes()
    (newest / MODEL).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"{newest / MODEL} does not match its digest")):
        verify(newest)
    (newest / MODEL).write_bytes(data)
    verify(newest)
    # A file of the same name from another checkpoint is well formed, but not this one's.
    shutil.copy(older / OPTIM, newest / OPTIM)
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"{newest / OPTIM} does not match")):
        verify(newest)


def test_added_missing_and_linked_files_and_a_missing_manifest_are_refused(two_tags):
    root, older, newest = two_tags
    extra = newest / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    shutil.copy(newest / OPTIM, extra)
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"{extra} is not listed")):
        verify(newest)
    extra.unlink()
    (newest / OPTIM).rename(newest / "moved")
    with pytest.raises(CheckpointIntegrityError):
        verify(newest)
    (newest / "moved").rename(newest / OPTIM)
    (newest / OPTIM).unlink()
    (newest / OPTIM).symlink_to(older / OPTIM)
    with pytest.raises(CheckpointIntegrityError, match="is a link or special file"):
        verify(newest)
    (older / MANIFEST).unlink()
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"checkpoint {older} has no {MANIFEST}")):
        verify(older)
    (older / MANIFEST).write_text('{"format": 1, "files": ["x"]}')
    with pytest.raises(CheckpointIntegrityError, match="malformed"):
        read_manifest(older)


def test_a_write_never_leaves_part_of_a_record_and_an_interrupted_one_is_not_in_the_checkpoint(two_tags):
    """Manifests, ``latest.json`` and FSDP2's client state are written whole (``write_whole``):
    a write that fails leaves the old file and no temporary one; the temporary file of a manifest
    write that a crash interrupted is not counted as part of the checkpoint."""
    root, _, newest = two_tags
    before = (root / LATEST).read_text()
    with pytest.raises(UnicodeEncodeError):
        write_whole(root / LATEST, "\ud800")  # a lone surrogate cannot be encoded: the write fails midway
    assert (root / LATEST).read_text() == before
    assert not [p.name for p in root.iterdir() if p.name.startswith(partial_name(root / LATEST))]
    (newest / f"{partial_name(newest / MANIFEST)}crashed.partial").write_text("{")
    assert MODEL in write_manifest(newest).files and verify(newest).files == write_manifest(newest).files


def test_a_file_that_cannot_be_inspected_is_never_clean(tmp_path):
    marker = tmp_path / "code-ran"
    allowed = deepspeed_checkpoint_globals()
    for legacy in (True, False):
        path = tmp_path / f"bad-{legacy}.pt"
        save({"t": torch.ones(2), "x": PlantedPickle(marker)}, path, legacy=legacy)
        # torch lists the globals of zip files only; a legacy one is "unknown", not "none".
        assert refused_globals(str(path), allowed) == (None if legacy else ["io.open"])
        with pytest.raises(UnsafeCheckpointError, match=re.escape(f"checkpoint file {path} ")):
            check_data_only(path, allowed)
    good = tmp_path / "good.pt"
    save({"t": torch.ones(2)}, good, legacy=True)
    check_data_only(good, allowed)
    good.write_bytes(good.read_bytes()[:20])
    with pytest.raises(UnsafeCheckpointError, match="could not be verified"):
        check_data_only(good, allowed)
    assert not marker.exists()


@pytest.mark.parametrize("legacy", [True, False], ids=["legacy-pickle", "zip-pickle"])
def test_a_dp_change_never_converts_a_planted_pickle(two_tags, legacy):
    """The universal conversion (a resume at another dp) refuses the file before DeepSpeed's
    converter unpickles anything, whether or not the manifest was rewritten to match it."""
    from orch.launchers.engines.deepspeed.universal import convert

    root, _, newest = two_tags
    marker = root / "code-ran"
    save({"exp_avg": torch.ones(2), "x": PlantedPickle(marker)}, newest / OPTIM, legacy=legacy)
    with pytest.raises(CheckpointIntegrityError, match=re.escape(str(newest / OPTIM))):
        convert(root, newest.name)
    write_manifest(newest)  # whoever can write the directory can rewrite its manifest too
    with pytest.raises(UnsafeCheckpointError, match=re.escape(f"checkpoint file {newest / OPTIM} ")):
        convert(root, newest.name)
    assert not marker.exists() and not (root / f"{newest.name}_universal").exists()


def test_resume_falls_back_to_the_newest_intact_checkpoint(two_tags, capsys):
    root, older, newest = two_tags
    (newest / OPTIM).write_bytes(b"cut short")
    chosen = resumable(root, None)
    assert (chosen.tag, chosen.step, chosen.run_id, chosen.layout["dp"]) == (tag_for(2), 2, "run1", 2)
    err = capsys.readouterr().err
    assert f"not resuming from {newest}: checkpoint file {newest / OPTIM} does not match" in err
    assert f"resuming from the newest intact checkpoint, {older}" in err
    (older / MANIFEST).unlink()
    with pytest.raises(NoIntactCheckpointError, match=r"train.resume=auto: no checkpoint kept in "
                                                      r"train.checkpoint_dir=.* verifies.*Fix: set train.resume=never"):
        resumable(root, None)


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    def signature(d_model: int) -> dict:
        return {"config": {"_target_": "orch.workloads.gpt.GPT", "d_model": d_model, "dropout": 0.0},
                "params": {"tok_emb.weight": [256, d_model]}}

    root = tmp_path / "ckpt"
    written(root, 2, model=signature(128))
    assert resumable(root, signature(128)).tag == tag_for(2)
    assert resumable(root, {**signature(128), "config": {"d_model": 128, "dropout": 0.1}})  # same shapes: fits
    with pytest.raises(PlanError) as info:
        resumable(root, signature(64))
    (violation,) = info.value.violations
    assert (violation.field, violation.value) == ("model.d_model", 64)
    assert "written with model.d_model=128" in violation.message and "tok_emb.weight" in violation.message
    assert violation.fix.startswith("set model.d_model=128, or train.resume=never")


@pytest.mark.parametrize("text, complaint", [
    ("{", "JSONDecodeError"),
    ('{"tag": "step_000000002", "tags": ["step_000000002"]}', "missing key 'step'"),
    ('{"tag": "step_000000002", "step": "2", "tags": ["step_000000002"]}', "step must be an integer"),
    ('{"tag": "step_000000002", "step": 2, "tags": "step_000000002"}', "tags a list"),
    ('[1, 2]', "a JSON object was expected, not list"),
], ids=["bad-json", "missing-key", "step-a-string", "tags-a-string", "not-an-object"])
def test_a_malformed_latest_json_is_a_clear_error(tmp_path, text, complaint):
    (tmp_path / LATEST).write_text(text)
    with pytest.raises(CheckpointRecordError) as info:
        latest(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / LATEST} is malformed (") and complaint in message
    assert "Fix: delete it to start fresh (or set train.resume=never)" in message


def test_one_run_at_a_time_holds_a_checkpoint_dir(tmp_path):
    root = tmp_path / "ckpt"
    with directory_lock(root):
        with pytest.raises(CheckpointDirBusyError, match=re.escape(f"train.checkpoint_dir={root} is in use by "
                                                                   "another orch run (pid ")) as info:
            with directory_lock(root):
                pass
        assert "Fix: give this run another train.checkpoint_dir, or wait" in str(info.value)
    with directory_lock(root):  # released when the holder ends
        pass
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointDirError, match=re.escape(f"train.checkpoint_dir={tmp_path / 'a-file'} cannot be "
                                                           "used: File exists")):
        with directory_lock(tmp_path / "a-file"):
            pass


def test_resuming_a_finished_run_never_changes_its_status(tmp_path):
    from mlflow.tracking import MlflowClient

    from orch.tracking.store import RunTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    finished = RunTracker.start(uri=uri, experiment="orch", run_name="done", params={}, tags={})
    finished.finish("FINISHED")
    failed = RunTracker.start(uri=uri, experiment="orch", run_name="broke", params={}, tags={})
    failed.finish("FAILED")
    client = MlflowClient(tracking_uri=uri)

    resumed = RunTracker.resume(uri=uri, run_id=finished.run_id)
    resumed.log_metrics({"loss": 1.0}, step=15)
    assert client.get_run(finished.run_id).info.status == "FINISHED"
    resumed.finish("FAILED")
    run = client.get_run(finished.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["orch.resume.status"] == "FAILED"
    assert [m.step for m in client.get_metric_history(finished.run_id, "loss")] == [15]

    # A run that did not finish is continued: RUNNING while it trains, then this attempt's status.
    again = RunTracker.resume(uri=uri, run_id=failed.run_id)
    assert client.get_run(failed.run_id).info.status == "RUNNING"
    again.finish("FINISHED")
    assert client.get_run(failed.run_id).info.status == "FINISHED"


def test_published_checkpoints_carry_their_manifest(tmp_path):
    folder = written(tmp_path, 6)
    record = json.loads((folder / MANIFEST).read_text())
    assert record["format"] == 1 and set(record["files"]) == {MODEL, OPTIM, OPTIM.replace("rank_0", "rank_1")}
    assert latest(tmp_path).tag == folder.name
    with pytest.raises(CheckpointIntegrityError, match="does not exist"):
        publish(tmp_path, 8, "run1", keep=2)  # nothing written for step 8


def test_orch_train_refuses_a_held_directory_and_a_malformed_record(tmp_path):
    """The real command: both refusals exit 2 with one line naming the fix, before torch is imported
    (``-X importtime`` lists every import) or Ray starts. A bad plan value is still reported first,
    as the run checks its plan before it takes the directory."""
    import subprocess
    import sys

    from helpers.processes import worker_env

    ckpt = tmp_path / "ckpt"

    def orch_train(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-X", "importtime", "-m", "orch", "train", "train.steps=2",
                               "train.checkpoint_every=2", f"train.checkpoint_dir={ckpt}", "tracking.enabled=false",
                               *overrides],
                              cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=300)

    with directory_lock(ckpt):  # as a run started a moment earlier holds it
        held = orch_train()
        held_bad_plan = orch_train("plan.zero_stage=7")
    (ckpt / LATEST).write_text('{"tag": "step_000000002"')
    malformed = orch_train("train.resume=auto")
    # Without a resume too: every save reads the record to prune old checkpoints.
    malformed_fresh = orch_train("train.resume=never")
    for done, expected in [(held, f"error: train.checkpoint_dir={ckpt} is in use by another orch run"),
                           (malformed, f"error: {ckpt / LATEST} is malformed (JSONDecodeError"),
                           (malformed_fresh, f"error: {ckpt / LATEST} is malformed (JSONDecodeError"),
                           (held_bad_plan, "plan.zero_stage=7")]:
        assert done.returncode == 2, done.stderr
        assert expected in done.stderr and "Traceback" not in done.stderr
        assert "Started a local Ray instance" not in done.stderr + done.stdout
        assert not re.search(r"^import time:.*\|\s+torch$", done.stderr, re.MULTILINE), "torch was imported"
    assert "is in use" not in held_bad_plan.stderr





class _PlantedPickle:
    """Unpickling this calls ``open(path, "w")``: proof, if the file appears, that a load ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_staged_checkpoint_a_load_refuses_is_removed_from_the_node(s3_store, tmp_path, monkeypatch):
    """The manifest was rewritten to match a planted file, so the download verifies; the weights-only
    load refuses it, and the staged copy must not stay on the node after the refusal."""
    import tempfile
    from types import SimpleNamespace

    import torch.distributed as dist

    from orch.launchers.checkpoint import publish_remote
    from orch.launchers.checkpoint_io import CheckpointIO
    from orch.launchers.manifest import file_digests
    from orch.launchers.safe_load import verified_loading
    from orch.launchers.storage import RemoteDir, staging_dir

    for name, value in s3_store["env"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the node's TMPDIR, where staging lives
    uri = f"s3://{s3_store['bucket']}/planted"
    marker = tmp_path / "code-ran"
    written = tmp_path / "written" / tag_for(2)
    written.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}, "planted": _PlantedPickle(marker)}, written / "model.pt")
    RemoteDir(uri).upload(written, tag_for(2))
    files, sizes = file_digests(written)
    publish_remote(uri, 2, "run1", 1, files, sizes)

    class OnNode(CheckpointIO):
        def root(self) -> str:  # the staging directory Ray's node id would name
            return str(staging_dir(self.location, "node-1"))

    class LoadsLikeDeepSpeed:
        """An engine's load as the DeepSpeed engine's goes: every file through verified_loading."""

        def load(self, root: str, tag: str):
            with verified_loading(os.path.join(root, tag), deepspeed_checkpoint_globals()):
                return torch.load(os.path.join(root, tag, "model.pt"))

    io = OnNode(SimpleNamespace(train=SimpleNamespace(checkpoint_dir=uri)), rank=0, local_rank=0, world_size=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(UnsafeCheckpointError, match="could run code when loaded: io.open"):
            io.restore(LoadsLikeDeepSpeed(), tag_for(2))
    finally:
        dist.destroy_process_group()
    assert not marker.exists()
    assert not staging_dir(uri, "node-1").exists()
