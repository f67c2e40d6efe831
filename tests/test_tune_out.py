"""Where `orch tune` may write its plan file: never inside the installed package, never out of
``tuned_plans/`` through ``tune.name``, never over a file it did not write. Each case runs the
installed `orch` command from a user's directory; each refusal is an exit 2 naming the field, the
value and the fix, before anything is tuned."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.config import compose_config
from helpers.orch_command import orch_run
from helpers.processes import worker_env
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.tune.plan_file import check_plan_file

ORCH = shutil.which("orch", path=os.path.dirname(sys.executable)) or "orch"


def orch_tune(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return orch_run(["tune", "train.global_batch_size=16", "tune.pp=[1]", *overrides], cwd=cwd, timeout=300)


def refused(done: subprocess.CompletedProcess, field: str, value: str, why: str, fix: str) -> bool:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{field}={value!r}: {why}" in done.stderr and f"Fix: {fix}" in done.stderr, done.stderr[-3000:]
    assert "tune: model probed" not in done.stderr  # refused before any tuning
    return True


def test_a_plan_file_inside_the_installed_package_is_refused_and_its_presets_stay_intact(tmp_path):
    from orch import conf

    preset = Path(conf.__file__).resolve().parent / "cluster" / "local_cpu.yaml"
    before = preset.read_bytes()
    (tmp_path / "preset.yaml").symlink_to(preset)
    try:
        direct = orch_tune(tmp_path, f"tune.out={preset}")
        linked = orch_tune(tmp_path, "tune.out=preset.yaml")
    finally:
        if preset.read_bytes() != before:  # the package under test must survive a failing run
            preset.write_bytes(before)
            pytest.fail(f"orch tune overwrote {preset}")
    inside = f"is inside the installed orch package ({preset.parents[2]})"
    fix = "write the plan outside it: leave tune.out unset for ./tuned_plans/plan/<tune.name>.yaml"
    assert refused(direct, "tune.out", str(preset), inside, fix)
    assert refused(linked, "tune.out", "preset.yaml", inside, fix)


def test_tune_name_must_be_a_plain_name_that_stays_in_tuned_plans(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    done = orch_tune(user, "tune.name=../../../x")
    assert refused(done, "tune.name", "../../../x", "is not a plain name",
                   "use letters, digits, '_' and '-' only (tune.name=tuned_v2), or tune.out=PATH")
    assert not (tmp_path / "x.yaml").exists() and not (user / "tuned_plans").exists()
    for name in ("a/b", ".hidden", "x y", "/abs", "-flag"):
        with pytest.raises(PlanError, match=r"tune.name='.*': is not a plain name"):
            check_plan_file(to_typed(compose_config(f"tune.name='{name}'"))[0])
    check_plan_file(to_typed(compose_config("tune.name=Tuned_v-2"))[0])


def test_tune_out_replaces_a_tuned_plan_and_never_a_file_it_did_not_write(tmp_path):
    notes = tmp_path / "notes.yaml"
    notes.write_text("my notes: keep them\n")
    done = orch_tune(tmp_path, "tune.out=notes.yaml")
    assert refused(done, "tune.out", "notes.yaml", "is an existing file that orch tune did not write",
                   "name a new file, or move that one away first if it should be replaced")
    assert notes.read_text() == "my notes: keep them\n"
    assert refused(orch_tune(tmp_path, f"tune.out={tmp_path}"), "tune.out", str(tmp_path), "is a directory",
                   "name a file")
    for _ in range(2):  # written, then replaced: a tuned plan is what a tune writes
        done = orch_tune(tmp_path, "tune.out=plans/plan/fast.yaml")
        assert done.returncode == 0, done.stderr[-3000:]
        assert (tmp_path / "plans/plan/fast.yaml").read_text().startswith("# Written by `orch tune` on ")


def test_a_plan_file_that_cannot_be_written_is_refused_before_tuning_and_a_late_failure_keeps_the_plan(tmp_path):
    (tmp_path / "notes.txt").write_text("not a directory\n")
    fix = "write it to a directory this user can write: tune.out=DIR/plan/NAME.yaml"
    done = orch_tune(tmp_path, "tune.out=notes.txt/plan/fast.yaml")
    assert refused(done, "tune.out", "notes.txt/plan/fast.yaml",
                   f"the plan file cannot be written to {tmp_path / 'notes.txt/plan/fast.yaml'}: its closest existing "
                   f"parent {tmp_path / 'notes.txt'} is not a directory.", fix)
    # A file system that takes no new files, even from root (who passes every permission check).
    cfg = to_typed(compose_config("tune.out=/proc/orch/plan/fast.yaml"))[0]
    with pytest.raises(PlanError, match="its closest existing parent /proc is a directory this user cannot create "
                                        r"files in \(No such file or directory\)"):
        check_plan_file(cfg)
    # Refused only after the search (the directory went away meanwhile): the plan reaches the user anyway.
    from orch.plans.resolve import resolve_plan
    from orch.plans.spec import PlanSpec
    from orch.tune.plan_file import write_plan_file

    winner = SimpleNamespace(predicted=SimpleNamespace(tokens_per_s=1000.0))
    result = SimpleNamespace(winner_trial=None, winner=winner, global_batch_size=16, plan_text=None)
    plan = resolve_plan(PlanSpec(dp=2), cfg.cluster, cfg.train)
    with pytest.raises(PlanError) as refusal:
        write_plan_file(plan, cfg, {"_target_": "orch.workloads.gpt.GPT"}, cfg.cluster, result)
    assert result.plan_text.startswith("# Written by `orch tune` on ") and "dp: 2" in result.plan_text
    assert str(refusal.value).endswith(f"{fix}; this run's tuned plan, to save by hand:\n{result.plan_text}")


def test_the_package_directories_are_those_this_process_imports():
    import orch
    from orch.tune.plan_file import package_dirs

    assert package_dirs() == [Path(orch.__file__).resolve().parent]  # one package: its parts are inside it


def test_on_object_storage_too_only_a_tuned_plan_is_replaced(tmp_path, s3_store):
    client, bucket = s3_store["client"], s3_store["bucket"]
    client.put_object(Bucket=bucket, Key="plans/notes.yaml", Body=b"my notes: keep them\n")
    env = {**worker_env(), **s3_store["env"]}

    def tune(out: str) -> subprocess.CompletedProcess:
        return orch_run(["tune", "train.global_batch_size=16", "tune.pp=[1]",
                         f"tune.out={out}"], cwd=tmp_path, env=env, timeout=300)

    notes = f"s3://{bucket}/plans/notes.yaml"
    assert refused(tune(notes), "tune.out", notes, "is an existing file that orch tune did not write",
                   "name a new file, or move that one away first if it should be replaced")
    assert client.get_object(Bucket=bucket, Key="plans/notes.yaml")["Body"].read() == b"my notes: keep them\n"
    for _ in range(2):  # written, then replaced
        done = tune(f"s3://{bucket}/plans/tuned.yaml")
        assert done.returncode == 0, done.stderr[-3000:]
    plan = client.get_object(Bucket=bucket, Key="plans/tuned.yaml")["Body"].read().decode()
    assert plan.startswith("# Written by `orch tune` on ")
