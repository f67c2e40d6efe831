"""``torch.distributed.checkpoint`` files read and written without trusting a pickle.

DCP writes one ``.distcp`` file per rank and a ``.metadata`` file that it reads back with plain
``pickle.load``; its default planner reads non-tensor values (an optimizer's hyper-parameters)
with ``torch.load(weights_only=False)``. Both could run code from a changed checkpoint. Here:

- every file of the tag is compared with the published manifest (:func:`orch.launchers.manifest.verify`)
  before DCP opens any of them;
- ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, which builds only DCP's own metadata
  dataclasses and enums, ``torch.Size`` and torch's dtypes, layouts and memory formats;
- non-tensor values are read with ``weights_only=True`` (:class:`WeightsOnlyLoadPlanner`);
- the loop's own state is JSON beside the DCP files (:func:`write_client_state`), tensors in it
  (the RNG state) as lists of numbers.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

from orch.launchers.safe_load import UnsafeCheckpointError
from orch.plans.errors import first_line
from orch.plans.storage.locations import write_whole

CLIENT_STATE = "client_state.json"
"""The loop's state (step, data positions, RNG, layout, loss), written by rank 0."""

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")


def write_client_state(folder: str | os.PathLike, state: dict[str, Any]) -> None:
    """``state`` as JSON in ``folder``; a tensor becomes ``{"tensor": [...], "dtype": ...}``."""
    write_whole(Path(folder) / CLIENT_STATE, json.dumps(state, default=_encode))


def read_client_state(folder: str | os.PathLike) -> dict[str, Any]:
    """The state :func:`write_client_state` wrote, tensors rebuilt (the caller verified the folder).

    A file that is no such state (malformed, or nested deeper than the parser recurses: a crafted
    file raised RecursionError in every rank) is refused naming the file.
    """
    path = Path(folder) / CLIENT_STATE
    try:
        state = json.loads(path.read_text(), object_hook=_decode)
    except (ValueError, RecursionError) as error:
        raise UnsafeCheckpointError(f"checkpoint file {path} is not the loop's state ({type(error).__name__}: "
                                    f"{str(error)[:200]}); it was not loaded. Fix: resume only from checkpoints "
                                    "this orchestrator wrote, or train.resume=never to start fresh") from None
    if not isinstance(state, dict):
        raise UnsafeCheckpointError(f"checkpoint file {path} holds a {type(state).__name__}, not the loop's state; "
                                    "it was not loaded")
    return state


def _encode(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": value.detach().cpu().reshape(-1).tolist(), "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape)}
    raise TypeError(f"the loop's checkpoint state holds a {type(value).__name__}, which is stored as JSON only "
                    "(numbers, strings, lists, dicts, tensors)")


def _decode(obj: dict[str, Any]) -> Any:
    if set(obj) != {"tensor", "dtype", "shape"}:
        return obj
    import torch

    dtype = getattr(torch, obj["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise UnsafeCheckpointError(f"{CLIENT_STATE} names {obj['dtype']!r}, which is not a torch dtype")
    return torch.tensor(obj["tensor"], dtype=dtype).reshape(obj["shape"])


_PLAIN = {("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
          ("torch.serialization", "_get_layout")}
"""Other globals DCP's metadata holds, each a constructor of plain data: the checkpoint's path
(``StorageMeta.checkpoint_id``) and torch's lookup of a layout by name."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: DCP's dataclasses and enums, ``torch.Size``, the
    dtypes, layouts and memory formats torch pickles by name, and :data:`_PLAIN`."""

    def find_class(self, module: str, name: str) -> Any:
        import dataclasses
        import enum
        import importlib

        import torch

        found = None
        if module in _DCP_MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if not (isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))):
                found = None
        elif module == "torch":
            found = getattr(torch, name, None)
            if not (found is torch.Size or isinstance(found, (torch.dtype, torch.layout, torch.memory_format))):
                found = None
        elif (module, name) in _PLAIN:
            found = getattr(importlib.import_module(module), name)
        if found is None:
            raise UnsafeCheckpointError(f"DCP metadata names {module}.{name}, which a checkpoint's metadata never "
                                        "holds; it was not loaded")
        return found


def read_metadata(path: str | os.PathLike) -> Any:
    """DCP's metadata file unpickled by :class:`_MetadataUnpickler`; refused (naming the file) if it
    names anything else."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(io.BytesIO(f.read())).load()
    except UnsafeCheckpointError as error:
        raise UnsafeCheckpointError(f"checkpoint file {path}: {error}. Fix: resume only from checkpoints this "
                                    "orchestrator wrote, or train.resume=never to start fresh") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
        raise UnsafeCheckpointError(f"checkpoint file {path} is not DCP metadata ({type(error).__name__}: "
                                    f"{str(error)[:200]}); it was not loaded") from None


def check_storage_files(folder: str | os.PathLike, metadata: Any) -> None:
    """Every data file the metadata names is a plain file name inside ``folder`` that exists and
    holds every byte range the metadata reads from it; refused naming the file otherwise.

    DCP joins the metadata's ``relative_path`` to the folder and opens it, so a rewritten
    ``.metadata`` could point a read outside the checkpoint (``../../x.distcp``); and a missing or
    cut-short shard fails deep inside DCP as a ``CheckpointException`` (a ``BaseException``) whose
    message names neither the file nor what is wrong with it.
    """
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or name != os.path.basename(name) or name in (".", ".."):
            raise UnsafeCheckpointError(
                f"checkpoint {folder}: its .metadata names the data file {name!r}, which is not a plain file name "
                "inside the checkpoint; nothing was read. Fix: resume only from checkpoints this orchestrator "
                "wrote, or train.resume=never to start fresh")
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(needed.items()):
        path = Path(folder, name)
        size = path.stat().st_size if path.is_file() else None
        if size is None or size < end:
            what = "is missing" if size is None else f"is cut short: {size} bytes, where the metadata reads up to {end}"
            raise CheckpointReadError(
                f"checkpoint file {path} {what}; the checkpoint cannot be read. Fix: use another checkpoint "
                "(train.resume=auto falls back to the newest intact one) or train.resume=never to start fresh")


class CheckpointReadError(UnsafeCheckpointError):
    """A DCP checkpoint's files cannot be read back (missing, cut short, unreadable)."""


def dcp_failure(folder: str | os.PathLike, error: BaseException) -> UnsafeCheckpointError:
    """DCP's ``CheckpointException`` (a ``BaseException``, which nothing above would catch) as an
    error naming the checkpoint, each failing rank and what it raised; one of our own refusals
    raised inside DCP's reader comes out as it is."""
    failures = getattr(error, "failures", None) or {}
    parts = []
    for rank, failure in sorted(failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, UnsafeCheckpointError):
            return exc
        parts.append(f"rank {rank}: {type(exc).__name__}: {first_line(exc, 200)}")
    detail = "; ".join(parts) or first_line(error, 200)
    return CheckpointReadError(f"checkpoint {folder} could not be read ({detail}). Fix: use another checkpoint "
                               "(train.resume=auto falls back to the newest intact one) or train.resume=never to "
                               "start fresh")


def checked_metadata(folder: str | os.PathLike) -> Any:
    """``folder``'s DCP metadata, read by :func:`read_metadata`, with the data files it names checked
    (:func:`check_storage_files`): called by every rank before DCP reads anything, since DCP reads
    the metadata on one rank only."""
    metadata = read_metadata(os.path.join(folder, ".metadata"))
    check_storage_files(folder, metadata)
    return metadata


def load_checked(state: dict[str, Any], folder: str | os.PathLike, *, no_dist: bool = False) -> None:
    """DCP's load of ``folder`` into ``state`` through :func:`verified_reader` and
    :func:`weights_only_planner`; DCP's own failure comes out as :func:`dcp_failure`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=verified_reader(folder), planner=weights_only_planner(), no_dist=no_dist)
    except CheckpointException as error:
        raise dcp_failure(folder, error) from None


def verified_reader(folder: str | os.PathLike):
    """A DCP reader of ``folder`` whose metadata is read by :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = read_metadata(self._get_metadata_path(kwargs.get("rank")))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return VerifiedReader(str(folder))


def weights_only_planner():
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element  # where DCP's planner takes it

            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnlyLoadPlanner()


def full_model_state(folder: str | os.PathLike) -> dict[str, Any]:
    """The whole model's weights from an FSDP2 checkpoint folder, in one process, without a process
    group (``orch export``): every shard of every rank put back together by DCP itself.

    The caller has verified every file against the manifest; the metadata is read by
    :func:`read_metadata` (refused if it names anything but DCP's data), and the tensors are read
    into empty ones of the sizes and dtypes it records, under the model's own names.
    """
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = checked_metadata(folder)
    prefix = "model."
    model = {key[len(prefix):]: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
             for key, entry in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    state = {"model": model}
    load_checked(state, folder, no_dist=True)
    return state["model"]
