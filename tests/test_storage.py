"""Checkpoints on object storage, against a real S3-compatible server on loopback: the location
checked before anything starts, publishing and pruning, and the checks a resume makes.

Training, a kill and a resume through a bucket run in ``test_cluster.py`` (two nodes) and
``test_universal_checkpoint.py`` (a resume at another dp)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from helpers.config import compose_config
from helpers.orch_command import orch_run
from orch.config import to_typed
from orch.inputs import validated_plan
from orch.launchers.checkpoint import CheckpointRecordError, latest, publish_remote, resumable, tag_for
from orch.launchers.manifest import file_digests
from orch.launchers.storage import RemoteDir, StagingDirError, location_violation, staging_dir
from orch.plans.errors import PlanError
from orch.plans.storage.locations import is_remote, local_path


@pytest.fixture
def s3_env(s3_store, monkeypatch):
    for name, value in s3_store["env"].items():
        monkeypatch.setenv(name, value)
    return s3_store


def test_file_uris_are_local_paths():
    assert not is_remote("/a/b") and not is_remote("file:///a/b") and is_remote("s3://bucket/a")
    assert local_path("file:///a/b") == "/a/b" and local_path("ckpt") == "ckpt"


def test_a_location_that_cannot_hold_checkpoints_is_refused_before_anything_starts(s3_env):
    def refused(location: str) -> str:
        cfg, _, _ = to_typed(compose_config("train.checkpoint_every=5", f"train.checkpoint_dir={location}"))
        with pytest.raises(PlanError) as info:
            validated_plan(cfg, cfg.cluster)
        [violation] = [v for v in info.value.violations if v.field == "train.checkpoint_dir"]
        assert violation.value == location
        return str(violation)

    assert "bucket 'missing', which does not exist" in refused("s3://missing/run")
    text = refused("s3://someone:hunter2@orch/run")
    assert "carries credentials" in text and "AWS_SECRET_ACCESS_KEY" in text
    assert "Unrecognized filesystem type" in refused("nosuchfs://orch/run")
    assert location_violation(f"s3://{s3_env['bucket']}/run") is None


def test_a_multi_node_run_refuses_a_relative_checkpoint_dir():
    cfg, _, _ = to_typed(compose_config("cluster.nodes=2", "cluster.devices_per_node=1", "train.checkpoint_every=5"))
    with pytest.raises(PlanError) as info:
        validated_plan(cfg, cfg.cluster)
    [violation] = info.value.violations
    assert violation.field == "train.checkpoint_dir" and "spans cluster.nodes=2 nodes" in violation.message
    assert "s3://bucket/run" in violation.fix


def _upload(store: RemoteDir, tmp_path, step: int, scale: float) -> tuple[dict, dict]:
    """A tag shaped like DeepSpeed's, written locally and uploaded as a node's first worker does."""
    folder = tmp_path / tag_for(step)
    folder.mkdir()
    torch.save({"module": {"w": torch.full((4,), scale)}}, folder / "mp_rank_00_model_states.pt")
    torch.save({"exp_avg": torch.full((2,), scale)}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    store.upload(folder, tag_for(step))
    return file_digests(folder)


def test_publishing_prunes_and_a_resume_skips_a_cut_short_object(s3_env, tmp_path):
    uri = f"s3://{s3_env['bucket']}/published"
    store = RemoteDir(uri)
    layout = {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 1}
    for step, scale in [(2, 1.0), (4, 2.0), (6, 3.0)]:
        files, sizes = _upload(store, tmp_path, step, scale)
        publish_remote(uri, step, "run1", keep=2, files=files, sizes=sizes, layout=layout)
    record = latest(uri)
    assert (record.tag, record.tags, record.layout) == (tag_for(6), [tag_for(4), tag_for(6)], layout)
    assert store.sizes(tag_for(2)) == {}  # pruned
    assert set(store.sizes(tag_for(6))) == {"manifest.json", "mp_rank_00_model_states.pt",
                                            "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    assert resumable(uri, None).tag == tag_for(6)

    # An upload cut short: the newest tag's object is shorter than its manifest records.
    store.write_text(f"{tag_for(6)}/mp_rank_00_model_states.pt", "truncated")
    warnings = io.StringIO()
    assert resumable(uri, None, warn=warnings).tag == tag_for(4)
    assert f"{uri}/{tag_for(6)}/mp_rank_00_model_states.pt holds 9 bytes" in warnings.getvalue()


def test_a_planted_remote_record_cannot_point_outside_the_directory(s3_env):
    uri = f"s3://{s3_env['bucket']}/planted"
    RemoteDir(uri).write_text("latest.json", json.dumps({"tag": "../other", "step": 1, "tags": ["../other"]}))
    with pytest.raises(CheckpointRecordError, match=r"s3://orch/planted/latest.json: tag='../other'"):
        latest(uri)


def test_a_tuned_plan_is_written_to_object_storage(s3_env):
    from omegaconf import OmegaConf

    from orch.plans.search.space import search
    from orch.tune.plan_file import check_plan_file, train_command, write_plan_file
    from orch.tune.result import TuneResult
    from orch.tune.search import prepare

    with pytest.raises(PlanError, match=r"tune.out='s3://missing/plans/tuned.yaml': its directory names the bucket"):
        check_plan_file(to_typed(compose_config("tune.out=s3://missing/plans/tuned.yaml"))[0])
    uri = f"s3://{s3_env['bucket']}/plans/tuned.yaml"
    typed, model_cfg, _ = to_typed(compose_config("train.global_batch_size=16", f"tune.out={uri}"))
    check_plan_file(typed)
    space, ctx = prepare(typed, model_cfg, typed.cluster)
    result = TuneResult(search=search(space, ctx), speeds=ctx.speeds, speeds_note="declared", global_batch_size=16)
    result.winner = result.search.best
    result.plan_file = write_plan_file(result.winner.plan, typed, model_cfg, typed.cluster, result)
    assert result.plan_file == uri and train_command(result) is None
    written = OmegaConf.create(RemoteDir(f"s3://{s3_env['bucket']}/plans").read_text("tuned.yaml"))
    assert written.defaults == ["plan_schema", "_self_"] and written.dp == result.winner.plan.dp


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temporary directory of this test as the node's TMPDIR (``tempfile`` caches the one it found)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_checkpoints_are_staged_in_a_directory_only_this_user_can_enter(private_tmp):
    import os
    import stat

    folder = staging_dir("s3://orch/run", "node-1")
    root = private_tmp / f"orch-staging-{os.getuid()}"
    assert folder.is_relative_to(root) and folder != staging_dir("s3://orch/other", "node-1")
    info = root.lstat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    assert staging_dir("s3://orch/run", "node-1") == folder  # every local rank finds the same one


@pytest.mark.parametrize("planted", ["open", "link"])
def test_a_staging_directory_others_could_enter_or_a_link_is_refused(private_tmp, planted):
    import os

    root = private_tmp / f"orch-staging-{os.getuid()}"
    if planted == "open":
        root.mkdir(mode=0o755)
        root.chmod(0o755)
    else:
        (private_tmp / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(private_tmp / "elsewhere")
    with pytest.raises(StagingDirError, match=r"must be this user's .* with mode 0700.* Fix: remove"):
        staging_dir("s3://orch/run", "node-1")


def test_a_download_that_fails_verification_is_removed_from_the_staging_directory(s3_env, tmp_path, private_tmp):
    from orch.launchers.checkpoint import download_verified
    from orch.launchers.manifest import CheckpointIntegrityError

    uri = f"s3://{s3_env['bucket']}/tampered"
    files, sizes = _upload(RemoteDir(uri), tmp_path, 2, 1.0)
    publish_remote(uri, 2, "run1", keep=2, files=files, sizes=sizes, layout={"dp": 1, "tp": 1, "pp": 1})
    folder = staging_dir(uri, "node-1") / tag_for(2)
    download_verified(uri, tag_for(2), folder)  # intact: kept for the ranks to load
    assert (folder / "mp_rank_00_model_states.pt").is_file()

    # The same size, other bytes: only the digest tells.
    name = f"{tag_for(2)}/mp_rank_00_model_states.pt"
    RemoteDir(uri).write_text(name, "x" * sizes["mp_rank_00_model_states.pt"])
    with pytest.raises(CheckpointIntegrityError, match="does not match its digest"):
        download_verified(uri, tag_for(2), folder)
    assert not folder.exists()


def test_train_refuses_a_staging_directory_others_could_enter_before_ray_starts(s3_env, tmp_path):
    """The workers refused it (StagingDirError) only after Ray and the workers had started; the
    driver checks it with the checkpoint location, as the user ran it."""
    import os

    from helpers.processes import worker_env

    node_tmp = tmp_path / "tmp"
    (node_tmp / f"orch-staging-{os.getuid()}").mkdir(parents=True, mode=0o777)
    (node_tmp / f"orch-staging-{os.getuid()}").chmod(0o777)
    location = f"s3://{s3_env['bucket']}/staged-run"
    done = orch_run(["train", "train.steps=2", "train.resume=auto",
                     f"train.checkpoint_dir={location}"], cwd=tmp_path, env={**worker_env(),
                     "TMPDIR": str(node_tmp)}, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"train.checkpoint_dir='{location}'" in done.stderr and "mode 0777" in done.stderr, done.stderr
    assert "Fix: remove" in done.stderr, done.stderr
    assert "Started a local Ray instance" not in done.stderr + done.stdout
