"""Resume at another data-parallel degree through DeepSpeed's universal checkpoints.

A regular DeepSpeed checkpoint is written per rank of one layout: its ZeRO optimizer shards only
load into the same dp degree. DeepSpeed's ``ds_to_universal`` converts one into a universal
checkpoint (every parameter's fp32 weights and optimizer states whole, one folder each), which
``deepspeed.initialize`` with ``checkpoint.load_universal`` loads into any dp. Universal
checkpoints come from the ZeRO optimizers, so both the run that wrote the checkpoint and the one
that resumes need ZeRO stage 1 or more, and tp and pp must stay what they were (the converter
merges tensor-parallel slices, but pipeline layer files are loaded per stage).

The converter and the universal loader unpickle without ``weights_only``. So the input is first
checked against its manifest and read whole by the weights-only unpickler (a file that cannot be
read that way is refused); the converter runs with ``torch.load`` made weights-only
(:mod:`orch.launchers.engines.deepspeed.safe_convert`); and its output is read the same way, then given a manifest of
its own, which the workers check before they load it (:mod:`orch.launchers.safe_load`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from orch.launchers.checkpoint import UNIVERSAL_SUFFIX, layout_of
from orch.launchers.manifest import CheckpointIntegrityError, verify, write_manifest
from orch.launchers.storage import RemoteDir, staging_dir
from orch.plans.errors import OrchError, PlanError, Violation
from orch.plans.storage.locations import is_remote, local_path

# The layout keys whose change needs a universal checkpoint, and those that may not change at all.
ELASTIC = ("dp",)
FIXED = ("tp", "pp")


class UniversalCheckpointError(OrchError):
    """The conversion to a universal checkpoint failed."""


def needs_universal(saved: dict[str, int] | None, plan) -> bool:
    """Whether resuming ``plan`` from a checkpoint written with layout ``saved`` changes the dp degree.

    Raises :class:`PlanError` for changes no checkpoint format can bridge.
    """
    if not saved:
        return False
    now = layout_of(plan)
    problems = [Violation(f"plan.{key}", now[key],
                          f"the checkpoint to resume was written with {key}={saved[key]}; a resume may change "
                          "dp (through a universal checkpoint) but not tp or pp.",
                          f"set plan.{key}={saved[key]}, or train.resume=never to start fresh")
                for key in FIXED if key in saved and saved[key] != now[key]]
    changed = any(key in saved and saved[key] != now[key] for key in ELASTIC)
    if changed:
        for name, stage in (("the checkpoint", saved.get("zero_stage", 0)), ("this plan", plan.zero_stage)):
            if stage < 1:
                problems.append(Violation(
                    "plan.zero_stage", plan.zero_stage,
                    f"resuming at dp={plan.dp} from a checkpoint written at dp={saved['dp']} needs a universal "
                    f"checkpoint, which DeepSpeed builds from ZeRO optimizer states: {name} has ZeRO stage {stage}.",
                    f"resume with plan.dp={saved['dp']}, or write checkpoints with plan.zero_stage=1 or more"))
    if problems:
        raise PlanError(problems)
    return changed


def _check_files(folder: Path) -> None:
    """Read every ``.pt`` file of ``folder`` with the weights-only unpickler; refuse any it cannot read."""
    from orch.launchers.engines.deepspeed.checkpoint_files import deepspeed_checkpoint_globals
    from orch.launchers.safe_load import check_data_only

    allowed = deepspeed_checkpoint_globals()
    for path in sorted(folder.rglob("*.pt")):
        check_data_only(path, allowed)


def _converted(target: Path) -> bool:
    """Whether ``target`` holds a finished conversion: its manifest (written last) verifies."""
    if not target.exists():
        return False
    try:
        verify(target)
        return True
    except CheckpointIntegrityError:
        return False


def convert(checkpoint_dir: str | os.PathLike, tag: str, env: dict[str, str] | None = None) -> str:
    """Convert the published ``tag`` into ``<tag>_universal`` (once) and return the new tag.

    Runs DeepSpeed's own converter (through :mod:`orch.launchers.engines.deepspeed.safe_convert`) in a child process:
    it forks worker pools and prints progress, neither of which belongs in the driver. Raises
    :class:`CheckpointIntegrityError` or ``UnsafeCheckpointError`` naming a file that fails the
    checks, before anything of it is unpickled without ``weights_only``.
    """
    if is_remote(checkpoint_dir):
        return _convert_remote(str(checkpoint_dir), tag, env)
    root = Path(local_path(checkpoint_dir))
    source, target = root / tag, root / f"{tag}{UNIVERSAL_SUFFIX}"
    if _converted(target):
        return target.name
    shutil.rmtree(target, ignore_errors=True)  # an interrupted or altered conversion is redone
    verify(source)
    _check_files(source)
    done = subprocess.run(
        [sys.executable, "-m", "orch.launchers.engines.deepspeed.safe_convert", "--input_folder", str(source),
         "--output_folder", str(target), "--num_extract_workers", "1", "--num_merge_workers", "1",
         # Without AutoTP nothing needs merging, and the model records no universal-checkpoint
         # info; the converter then adds the minimal one (its version) itself.
         "--inject_missing_state"],
        env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise UniversalCheckpointError(f"DeepSpeed could not convert {source} into a universal checkpoint:\n{tail}")
    _check_files(target)
    write_manifest(target)
    return target.name


def _convert_remote(uri: str, tag: str, env: dict[str, str] | None) -> str:
    """:func:`convert` of a tag on object storage: downloaded (and verified) here, converted, and
    the conversion uploaded next to it, where the workers download it from."""
    store = RemoteDir(uri)
    staging = staging_dir(uri, "driver")
    try:
        store.download(tag, staging / tag)
        converted = convert(staging, tag, env)
        store.delete(converted)
        store.upload(staging / converted, converted)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return converted
