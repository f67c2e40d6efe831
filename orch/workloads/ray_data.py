"""Data at cluster scale: ``data=ray`` streams files or URIs through Ray Data.

This module is imported by every Ray Data task that transforms the data, so torch is imported
only where a tensor is made (the planner's example batch), not at the top.

The files are read by Ray Data tasks (``ray.data.read_parquet``, ``read_json``, ``read_text`` or
``read_images``), turned into samples by Ray Data tasks too (tokenized and packed into windows,
decoded images with their class, or named columns), and handed to the data-parallel replicas
through ``Dataset.streaming_split``: blocks flow through Ray's object store while they are
consumed, so no worker (and not the driver) ever holds the whole dataset, and the data need not
fit on any one node's disk or memory. The driver makes the splits for each attempt of the worker
group (:meth:`RayDataSource.streams`); the first rank of each replica reads its split and passes
the batches to the replica's other readers (:class:`orch.launchers.batches.ReplicaBatches`).

The evaluation split is ``val_paths`` when given; otherwise a stable hash of each raw row (a line,
a record, an image's path) holds out ``val_fraction`` of them, decided row by row as the data
streams, so the same rows are held out in every run and every epoch.

Resume is at epoch granularity: a checkpoint records the epoch, and a resumed run starts that
epoch again from its beginning. A stream's order is not reproducible from run to run (the read
tasks finish in any order), so a position inside an epoch could not be restored exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

from orch.plans.errors import Violation
from orch.plans.storage.locations import StorageTimeout, bounded, is_remote, open_location, probe_limit_s
from orch.plans.storage.uris import CREDENTIALS_FIX, carries_credentials
from orch.workloads.schemas import from_schema
from orch.workloads.text_rows import first_bad_row

if TYPE_CHECKING:
    import torch

FORMATS = ("parquet", "json", "text", "images")
SAMPLES = ("tokens", "images", "columns")
_SUFFIX_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
_HASH_BUCKETS = 10_000
_FIX = "point data.paths at files, directories or URIs (s3://bucket/prefix) that hold the data"


@dataclass(kw_only=True)
class RayDataConfig:
    """``data=ray``: files or URIs streamed through Ray Data."""

    _target_: str = "orch.workloads.ray_data.RayDataSource"
    paths: list[str] = field(default_factory=list)
    """Files, directories or URIs (s3://, gs://, file://) to read; a directory is read whole."""
    format: str | None = None
    """parquet, json (JSON lines), text (one row per line) or images; null: from the first path's suffix."""
    sample: str = "tokens"
    """What a sample is: tokens (text packed into seq_len windows), images (folder per class), columns."""
    val_paths: list[str] | None = None
    """A separate evaluation set; null: hold out val_fraction of the rows by a stable hash."""
    val_fraction: float = 0.05
    """Share of the rows held out for evaluation when val_paths is null."""
    text_field: str = "text"
    """sample=tokens: the column holding the text in parquet and json rows."""
    tokenizer: str | None = None
    """sample=tokens: a local save_pretrained tokenizer directory; null: UTF-8 bytes (256 tokens)."""
    seq_len: int = 128
    """sample=tokens: tokens per sample."""
    image_size: int = 32
    """sample=images: images are resized to image_size x image_size RGB."""
    columns: list[str] | None = None
    """sample=columns: the columns passed to the model by name (model(**batch)); null: all but label_column."""
    label_column: str | None = None
    """sample=columns: the column passed as ``labels`` (the classification objective's targets)."""
    shuffle_buffer: int = 0
    """Rows each replica shuffles among locally, reseeded every epoch; 0: read order."""
    cpus_per_task: float = 1.0
    """CPUs each Ray Data task reserves; an embedded Ray adds one such CPU beside the workers'."""


@lru_cache(maxsize=4)
def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def _row_bucket(key: Any) -> int:
    """A raw row's stable place in [0, 10000): the same row lands in the same split everywhere."""
    data = key.encode("utf-8") if isinstance(key, str) else repr(key).encode("utf-8")
    return zlib.crc32(data) % _HASH_BUCKETS


@dataclass(frozen=True)
class _Pack:
    """Ray Data batch function: text rows to windows of ``seq_len + 1`` token ids."""

    field: str
    seq_len: int
    tokenizer: str | None

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        texts = [str(text) + "\n" for text in batch[self.field]]
        # Windows travel through the object store in the smallest type that holds the vocabulary
        # (bytes: uint8, 8x smaller than int64); the worker widens them to int64 per micro-batch.
        if self.tokenizer is None:
            stream = np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8)
        else:
            ids = _load_tokenizer(self.tokenizer)(texts, add_special_tokens=False)["input_ids"]
            stream = np.fromiter((t for row in ids for t in row), dtype=np.int32)
        # Windows share their edge token, as data=text packs them: one's inputs end where the next start.
        count = max((len(stream) - 1) // self.seq_len, 0)
        windows = [stream[i * self.seq_len: i * self.seq_len + self.seq_len + 1] for i in range(count)]
        return {"ids": np.stack(windows) if windows else np.zeros((0, self.seq_len + 1), dtype=stream.dtype)}


@dataclass(frozen=True)
class _Images:
    """Ray Data batch function: decoded HxWx3 uint8 images to normalized CHW floats and class indices."""

    classes: tuple[str, ...]

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        images = np.asarray(batch["image"], dtype=np.float32) / 255.0
        index = {name: i for i, name in enumerate(self.classes)}
        labels = np.array([index[str(name)] for name in batch["class"]], dtype=np.int64)
        return {"image": ((images - 0.5) / 0.5).transpose(0, 3, 1, 2).copy(), "labels": labels}


@dataclass(frozen=True)
class _Columns:
    """Ray Data batch function: the chosen columns, floats as float32 and integers as int64."""

    columns: tuple[str, ...]
    label_column: str | None

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        out = {}
        for name in (*self.columns, *([self.label_column] if self.label_column else [])):
            array = np.asarray(batch[name])
            if array.dtype == object:  # lists of numbers, one per row
                array = np.stack([np.asarray(v) for v in array])
            array = array.astype(np.float32 if array.dtype.kind == "f" else np.int64)
            out["labels" if name == self.label_column else name] = array
        return out


@dataclass(frozen=True)
class _HeldOut:
    """Ray Data batch function: the rows of a batch that belong to the evaluation split (or, negated, to training).

    Per batch of columns rather than per row: Ray's row filter builds a dict per row, which cost
    several times the hashing itself.
    """

    key: str | None
    threshold: int
    evaluation: bool

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        names = [self.key] if self.key else sorted(batch)
        columns = [batch[name].tolist() for name in names]
        rows = zip(*columns, strict=True)
        keys = columns[0] if self.key else [list(zip(names, values, strict=True)) for values in rows]
        keep = np.fromiter(((_row_bucket(key) < self.threshold) == self.evaluation for key in keys),
                           dtype=bool, count=len(keys))
        return {name: values[keep] for name, values in batch.items()}


def _tokens_to_batch(columns: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = columns["ids"].long()
    return ids[:, :-1], ids[:, 1:]


def _image_to_batch(columns: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return columns["image"], columns["labels"]


def _columns_to_batch(columns: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(columns)


@dataclass(frozen=True, kw_only=True)
class RayDataSource:
    """Files or URIs streamed through Ray Data, as a :class:`orch.plans.model.workload.StreamingSource`."""

    paths: list[str] | str = from_schema(RayDataConfig, "paths")
    format: str | None = from_schema(RayDataConfig, "format")
    sample: str = from_schema(RayDataConfig, "sample")
    val_paths: list[str] | str | None = from_schema(RayDataConfig, "val_paths")
    val_fraction: float = from_schema(RayDataConfig, "val_fraction")
    text_field: str = from_schema(RayDataConfig, "text_field")
    tokenizer: str | None = from_schema(RayDataConfig, "tokenizer")
    seq_len: int = from_schema(RayDataConfig, "seq_len")
    image_size: int = from_schema(RayDataConfig, "image_size")
    columns: list[str] | None = from_schema(RayDataConfig, "columns")
    label_column: str | None = from_schema(RayDataConfig, "label_column")
    shuffle_buffer: int = from_schema(RayDataConfig, "shuffle_buffer")
    cpus_per_task: float = from_schema(RayDataConfig, "cpus_per_task")

    # --- what the planner and the checks read (no Ray) ------------------------------------------

    @property
    def path_list(self) -> list[str]:
        return [self.paths] if isinstance(self.paths, str) else list(self.paths)

    @property
    def val_path_list(self) -> list[str]:
        if self.val_paths is None:
            return []
        return [self.val_paths] if isinstance(self.val_paths, str) else list(self.val_paths)

    @property
    def read_format(self) -> str | None:
        if self.format:
            return self.format
        if self.sample == "images":
            return "images"
        candidates = self.path_list[:1]
        if candidates and not _format_of(candidates[0]):
            try:  # a directory or prefix: its first file tells
                candidates = [path for path, _ in self.listing[:1]]
            except (OSError, ValueError):
                candidates = []
        return _format_of(candidates[0]) if candidates else None

    @property
    def tokens_per_sample(self) -> int | None:
        return self.seq_len if self.sample == "tokens" else None

    @property
    def required_outputs(self) -> int | None:
        if self.sample == "tokens":
            from orch.workloads.corpus import BYTE_VOCAB

            return BYTE_VOCAB if self.tokenizer is None else len(_load_tokenizer(self.tokenizer))
        if self.sample == "images":
            return len(self.classes)
        return None

    @property
    def cpus(self) -> float:
        """CPUs the data's tasks need beside the workers' (one task at a time at least)."""
        return self.cpus_per_task

    @cached_property
    def listing(self) -> list[tuple[str, int]]:
        """Every file to read with its size, through ``pyarrow.fs`` (local paths and URIs alike)."""
        return _probed(self.path_list, lambda: _list_files(self.path_list, images=self.sample == "images"))

    @cached_property
    def val_listing(self) -> list[tuple[str, int]]:
        """The files of ``val_paths`` with their sizes (empty without them)."""
        if not self.val_path_list:
            return []
        return _probed(self.val_path_list, lambda: _list_files(self.val_path_list, images=self.sample == "images"))

    @cached_property
    def classes(self) -> tuple[str, ...]:
        """sample=images: the class names, the subdirectories of the (first) path, in sorted order."""
        return _probed(self.path_list[:1], lambda: _subdirectories(self.path_list[0])) if self.path_list else ()

    def violations(self, samples_per_step: int = 1) -> list[Violation]:
        """What cannot work; a store that does not answer within ``cluster.connect_timeout_s`` is one."""
        try:
            return self._violations(samples_per_step)
        except StorageTimeout as error:
            return [Violation("data.paths", self.paths, error.reason(), error.fix())]

    def _violations(self, samples_per_step: int) -> list[Violation]:
        if self.sample not in SAMPLES:
            return [Violation("data.sample", self.sample, "is not a kind of sample data=ray makes.",
                              f"set data.sample to one of {', '.join(SAMPLES)}")]
        if self.format is not None and self.format not in FORMATS:
            return [Violation("data.format", self.format, "is not a format data=ray reads.",
                              f"set data.format to one of {', '.join(FORMATS)}, or null to infer it")]
        if not self.path_list:
            return [Violation("data.paths", self.paths, "names nothing to read.", _FIX)]
        for name, value, paths in (("data.paths", self.paths, self.path_list),
                                   ("data.val_paths", self.val_paths, self.val_path_list)):
            if any(carries_credentials(path) for path in paths):
                return [Violation(name, value, "carries credentials in a URI, where they would be recorded with "
                                  "the run's config.", CREDENTIALS_FIX)]
        try:
            listing = self.listing
            if self.val_path_list and not self.val_listing:
                return [Violation("data.val_paths", self.val_paths, "matches no file.", _FIX)]
        except StorageTimeout:
            raise
        except (OSError, ValueError) as error:
            return [Violation("data.paths", self.paths, f"cannot be listed: {type(error).__name__}: "
                              f"{str(error).splitlines()[0][:300]}.", _FIX + "; check the store's endpoint and "
                              "credentials in the environment")]
        if not listing:
            what = f"no image file ({', '.join(_IMAGE_SUFFIXES)})" if self.sample == "images" else "no file"
            return [Violation("data.paths", self.paths, f"matches {what}.", _FIX)]
        if sum(size for _, size in listing) == 0:
            return [Violation("data.paths", self.paths, "holds only empty files.", _FIX)]
        if self.read_format is None:
            return [Violation("data.format", None, f"cannot be inferred from {self.path_list[0]!r}.",
                              f"set data.format to one of {', '.join(FORMATS)}")]
        if self.sample == "images" and self.read_format != "images":
            return [Violation("data.format", self.read_format, "cannot give data.sample=images.",
                              "set data.format=images (or null)")]
        if self.sample != "images" and self.read_format == "images":
            return [Violation("data.sample", self.sample, "does not read data.format=images.",
                              "set data.sample=images")]
        if self.sample == "columns" and self.read_format == "text":
            return [Violation("data.sample", self.sample, "needs named columns, which text lines do not have.",
                              "read parquet or json, or set data.sample=tokens")]
        if self.val_paths is None and not 0 < self.val_fraction < 1:
            return []  # reported by the range checks
        if self.sample == "images":
            if len(self.classes) < 2:
                return [Violation("data.paths", self.path_list[0], f"has {len(self.classes)} class "
                                  "subdirectories; classification needs at least 2.",
                                  "give one subdirectory of images per class")]
            return []
        if self.sample == "tokens":
            if self.tokenizer is not None:
                try:
                    _load_tokenizer(self.tokenizer)
                except Exception as error:  # noqa: BLE001 - transformers raises several types
                    return [Violation("data.tokenizer", self.tokenizer, f"cannot be loaded: {type(error).__name__}: "
                                      f"{str(error)[:300]}.", "point data.tokenizer at a local save_pretrained "
                                      "directory, or set data.tokenizer=null for byte tokens")]
            if self.read_format in ("parquet", "json") and self.text_field not in self.schema_names:
                return [Violation("data.text_field", self.text_field, f"is not a column of {self.listing[0][0]} "
                                  f"(it has: {', '.join(self.schema_names[:20])}).",
                                  "set data.text_field to the column holding the text")]
            bad = self._first_bad_row()
            if bad:
                return [bad]
            train, val = self.sizes()
            if min(train, val) < samples_per_step:
                return [Violation("data.paths", self.paths, f"too little text: about {train} training and {val} "
                                  f"evaluation windows of data.seq_len + 1 = {self.seq_len + 1} tokens (estimated "
                                  f"at one token per byte); each part needs {samples_per_step}.",
                                  "add data, or lower data.seq_len or raise data.val_fraction")]
            return []
        wanted = [*(self.columns or []), *([self.label_column] if self.label_column else [])]
        missing = [name for name in wanted if name not in self.schema_names]
        if missing:
            return [Violation("data.columns" if missing[0] != self.label_column else "data.label_column",
                              missing[0], f"is not a column of {self.listing[0][0]} (it has: "
                              f"{', '.join(self.schema_names[:20])}).", "name columns the data has")]
        return []

    def _first_bad_row(self) -> Violation | None:
        """The first line of text or JSON rows the tokenizer could not read, in any file of either split."""
        if self.read_format not in ("text", "json"):
            return None
        for name, listing in (("data.paths", self.listing), ("data.val_paths", self.val_listing)):
            for location, _ in listing:
                bad = first_bad_row(location, self.read_format, self.text_field)
                if bad:
                    return Violation(name, location, f"line {bad.line} {bad.problem}", bad.fix)
        return None

    @cached_property
    def _first_rows(self):
        """The first rows of the first file, as a pyarrow table (schema and shapes for the planner)."""
        import pyarrow.dataset as pads

        path, _ = self.listing[0]
        kind = "parquet" if self.read_format == "parquet" else "json"

        def head():
            fs, inner = _filesystem(path)
            return pads.dataset(inner, format=kind, filesystem=fs).head(2)

        return _probed([path], head)

    @property
    def schema_names(self) -> list[str]:
        return list(self._first_rows.schema.names)

    @property
    def model_columns(self) -> tuple[str, ...]:
        if self.columns:
            return tuple(self.columns)
        return tuple(name for name in self.schema_names if name != self.label_column)

    def sizes(self) -> tuple[int, int]:
        """Estimated samples in the training and evaluation splits (the stream's own count is known
        only once read): windows at one token per byte, images by file, rows of parquet metadata."""
        train = self._estimated_samples(self.listing)
        if self.val_paths is not None:
            return train, self._estimated_samples(self.val_listing)
        held = int(train * self.val_fraction)
        return train - held, held

    def _estimated_samples(self, listing: list[tuple[str, int]]) -> int:
        if self.sample == "tokens":
            return max((sum(size for _, size in listing) - 1) // self.seq_len, 0)
        if self.sample == "images":
            return len(listing)
        if self.read_format == "parquet":
            import pyarrow.parquet as pq

            def rows(path: str) -> int:
                fs, inner = _filesystem(path)
                with fs.open_input_file(inner) as handle:
                    return pq.ParquetFile(handle).metadata.num_rows

            return sum(_probed([path], lambda path=path: rows(path)) for path, _ in listing)
        row_bytes = max(len(json.dumps(self._first_rows.slice(0, 1).to_pylist()[0])), 1)
        return sum(size for _, size in listing) // row_bytes

    def example_batch(self, batch_size: int):
        import torch

        if self.sample == "tokens":
            shape = (batch_size, self.seq_len)
            return (torch.zeros(shape, dtype=torch.long, device="meta"),
                    torch.zeros(shape, dtype=torch.long, device="meta"))
        if self.sample == "images":
            return (torch.zeros((batch_size, 3, self.image_size, self.image_size), device="meta"),
                    torch.zeros((batch_size,), dtype=torch.long, device="meta"))
        converted = _Columns(self.model_columns, self.label_column)(self._first_rows.to_pydict())
        return {name: torch.zeros((batch_size, *array.shape[1:]), device="meta",
                                  dtype=torch.float32 if array.dtype.kind == "f" else torch.long)
                for name, array in converted.items()}

    def prepare(self) -> None:
        """Nothing is cached: the stream is read and transformed as it is consumed."""

    def datasets(self):
        raise TypeError("data=ray is streamed, not opened as map-style datasets: the driver makes its splits "
                        "(RayDataSource.streams)")

    def collate(self) -> Callable[[list], Any] | None:
        return None

    def describe(self) -> dict[str, Any]:
        listing = self.listing
        digest = hashlib.sha256()
        for path, size in sorted(listing):
            digest.update(f"{path}|{size}\n".encode())
        return {"name": self.path_list[0] if len(self.path_list) == 1 else f"{len(self.path_list)} paths",
                "source": self.path_list, "size": sum(size for _, size in listing), "unit": "bytes",
                "digest": digest.hexdigest(), "files": len(listing), "format": self.read_format,
                "sample": self.sample}

    # --- what the driver and the workers use (Ray) ----------------------------------------------

    def to_batch(self) -> Callable[[dict[str, torch.Tensor]], Any]:
        """How a dict of column tensors (Ray's torch batch) becomes the batch the model takes."""
        return {"tokens": _tokens_to_batch, "images": _image_to_batch, "columns": _columns_to_batch}[self.sample]

    def ray_dataset(self, evaluation: bool):
        """The training or evaluation split as a lazy Ray Dataset of samples."""
        import ray.data

        # The driver reports the run's progress; Ray Data's own bars and execution plans would
        # interleave with it (they stay in Ray's logs).
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        remote = {"num_cpus": self.cpus_per_task}
        paths = self.val_path_list if evaluation and self.val_paths is not None else self.path_list
        kind = self.read_format
        if kind == "images":
            from ray.data.datasource.partitioning import Partitioning

            root = paths[0].rstrip("/")
            ds = ray.data.read_images(paths, size=(self.image_size, self.image_size), mode="RGB",
                                      include_paths=True, **remote,
                                      partitioning=Partitioning("dir", field_names=["class"], base_dir=root))
            key = "path"
        elif kind == "text":
            ds = ray.data.read_text(paths, **remote)
            key = "text"
        elif kind == "parquet":
            ds = ray.data.read_parquet(paths, **remote)
            key = self.text_field if self.sample == "tokens" else None
        else:
            ds = ray.data.read_json(paths, lines=True, **remote)
            key = self.text_field if self.sample == "tokens" else None
        if self.val_paths is None:
            ds = ds.map_batches(_HeldOut(key, round(self.val_fraction * _HASH_BUCKETS), evaluation),
                                batch_format="numpy", batch_size=4096, **remote)
        if self.sample == "tokens":
            field_name = "text" if kind == "text" else self.text_field
            return ds.map_batches(_Pack(field_name, self.seq_len, self.tokenizer), batch_size=1024, **remote)
        if self.sample == "images":
            return ds.map_batches(_Images(self.classes), batch_size=64, **remote)
        return ds.map_batches(_Columns(self.model_columns, self.label_column), batch_size=1024, **remote)

    def streams(self, dp: int, eval_samples: int) -> list[tuple[Any, Any]]:
        """One ``(training, evaluation)`` pair of Ray ``DataIterator`` per data-parallel replica,
        of equal length (``streaming_split(dp, equal=True)``): made in the driver, per attempt.

        The evaluation set is the held-out split's first ``eval_samples`` samples (in file order),
        read here and kept in the object store, so every evaluation reads the same samples. Streamed instead,
        its execution would start while the training stream's is paused mid-epoch holding the
        data's CPUs and object store, and wait for them for ever.
        """
        train = self.ray_dataset(evaluation=False).streaming_split(dp, equal=True)
        held_out = self.ray_dataset(evaluation=True)
        # Blocks in file order: the first samples are the same ones in every attempt and run.
        held_out.context.execution_options.preserve_order = True
        held_out = held_out.limit(eval_samples).materialize()
        evaluation = held_out.streaming_split(dp, equal=True)
        return list(zip(train, evaluation, strict=True))


def _format_of(path: str) -> str | None:
    for suffix, kind in _SUFFIX_FORMATS.items():
        if path.endswith(suffix) or path.endswith(suffix + ".gz"):
            return kind
    return None


def _filesystem(location: str):
    """The ``pyarrow.fs`` filesystem of a path or URI, and the path inside it (a store with its own
    time limits at ``cluster.connect_timeout_s``: only the driver's checks open one here)."""
    import pyarrow.fs as pafs

    if is_remote(location):
        return open_location(location, probe_limit_s())
    path = location[len("file://"):] if location.lower().startswith("file://") else location
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def _probed(locations: list[str], call: Callable[[], Any]) -> Any:
    """``call()``, given up after ``cluster.connect_timeout_s`` when it reaches a store
    (:func:`orch.plans.storage.locations.bounded`); local files are read without a limit."""
    return bounded(call) if any(is_remote(location) for location in locations) else call()


def _list_files(locations: list[str], *, images: bool) -> list[tuple[str, int]]:
    """``(location, size)`` of every file under ``locations`` (a directory recursively), in order."""
    import pyarrow.fs as pafs

    found: list[tuple[str, int]] = []
    for location in locations:
        fs, inner = _filesystem(location)
        info = fs.get_file_info(inner)
        if info.type == pafs.FileType.File:
            found.append((location, info.size))
        elif info.type == pafs.FileType.Directory:
            prefix = location.rstrip("/")
            for entry in sorted(fs.get_file_info(pafs.FileSelector(inner, recursive=True)), key=lambda e: e.path):
                if entry.type != pafs.FileType.File or entry.base_name.startswith((".", "_")):
                    continue
                if images and not entry.base_name.lower().endswith(_IMAGE_SUFFIXES):
                    continue
                found.append((prefix + "/" + os.path.relpath(entry.path, inner.rstrip("/")), entry.size))
    return found


def _subdirectories(location: str) -> tuple[str, ...]:
    import pyarrow.fs as pafs

    fs, inner = _filesystem(location)
    if fs.get_file_info(inner).type != pafs.FileType.Directory:
        return ()
    entries = fs.get_file_info(pafs.FileSelector(inner))
    return tuple(sorted(e.base_name for e in entries if e.type == pafs.FileType.Directory
                        and not e.base_name.startswith(".")))
