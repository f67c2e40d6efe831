"""Tokenized text: ``data=text``, local ``.txt`` / ``.jsonl`` / ``.parquet`` files read through
Hugging Face ``datasets``, tokenized once and packed into windows of ``seq_len + 1`` tokens.

Tokenization is cached on disk as an Arrow dataset keyed by the files' contents, the tokenizer
and the window length: the first rank to need it builds it under a file lock, the others (and
later runs) open it memory-mapped, so no worker holds the corpus in its own heap.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from orch.plans.errors import Violation
from orch.plans.storage.locations import unwritable_reason
from orch.workloads.corpus import BYTE_VOCAB, SHIPPED_CORPUS
from orch.workloads.lineage import files_digest
from orch.workloads.local_files import missing_reason
from orch.workloads.schemas import TextDataConfig, from_schema
from orch.workloads.text_rows import first_bad_row

_FORMATS = {".txt": "text", ".gz": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_FIX = "point data.files at local .txt, .jsonl or .parquet files (globs allowed)"


class _Windows(torch.utils.data.Dataset):
    """Rows of a memory-mapped Arrow table of token windows, as ``(inputs, next-token targets)``."""

    def __init__(self, table, start: int, stop: int):
        self.table, self.start, self.stop = table, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.tensor(self.table[self.start + i]["ids"], dtype=torch.long)
        return window[:-1], window[1:]


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``, which its holder may delete before it lets go.

    A waiter that gets the lock of a file deleted meanwhile holds a lock nobody else sees: it
    opens the path again (a new file) and locks that instead.
    """
    while True:
        handle = open(path, "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            current = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        handle.close()
    try:
        yield
    finally:
        handle.close()


@dataclass(frozen=True, kw_only=True)
class TextSource:
    """Packed token windows as a :class:`orch.plans.model.workload.DataSource`."""

    files: list[str] | str | None = from_schema(TextDataConfig, "files")
    text_field: str = from_schema(TextDataConfig, "text_field")
    tokenizer: str | None = from_schema(TextDataConfig, "tokenizer")
    seq_len: int = from_schema(TextDataConfig, "seq_len")
    val_fraction: float = from_schema(TextDataConfig, "val_fraction")
    cache_dir: str = from_schema(TextDataConfig, "cache_dir")

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len

    @cached_property
    def paths(self) -> list[Path]:
        patterns = [self.files] if isinstance(self.files, str) else list(self.files or [])
        if not patterns:
            return [SHIPPED_CORPUS]
        found: list[Path] = []
        for pattern in patterns:
            expanded = os.path.expanduser(pattern)
            found += [Path(p) for p in sorted(glob.glob(expanded))] if glob.has_magic(expanded) else [Path(expanded)]
        return found

    @cached_property
    def _tokenizer(self):
        if self.tokenizer is None:
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer, local_files_only=True, trust_remote_code=False)

    @property
    def required_outputs(self) -> int:
        return BYTE_VOCAB if self.tokenizer is None else len(self._tokenizer)

    def _format(self, path: Path) -> str | None:
        suffixes = path.suffixes
        return _FORMATS.get(suffixes[-2] if len(suffixes) > 1 and suffixes[-1] == ".gz" else path.suffix)

    def violations(self, samples_per_step: int = 1) -> list[Violation]:
        if not self.paths:
            return [Violation("data.files", self.files, "matches no file.", _FIX)]
        for path in self.paths:
            if not path.is_file():
                return [Violation("data.files", str(path), missing_reason(path) or "is not a regular file.", _FIX)]
            if self._format(path) is None:
                return [Violation("data.files", str(path), f"has a suffix data=text does not read ({path.suffix}).",
                                  _FIX)]
            if path.stat().st_size == 0:
                return [Violation("data.files", str(path), "is empty.", "remove it from data.files")]
            if not os.access(path, os.R_OK):
                return [Violation("data.files", str(path), "cannot be read by this user.", _FIX)]
            missing = self._missing_field(path)
            if missing:
                return [missing]
        for path in self.paths:
            kind = self._format(path)
            bad = first_bad_row(str(path), kind, self.text_field) if kind in ("text", "json") else None
            if bad:
                return [Violation("data.files", str(path), f"line {bad.line} {bad.problem}", bad.fix)]
        cache = self._cache_path
        if not (cache / "done").exists() and (why := unwritable_reason(cache.parent)):
            return [Violation("data.cache_dir", self.cache_dir, f"the tokenized files cannot be cached there: {why}.",
                              "point data.cache_dir at a directory this user can write (one every node sees, "
                              "for several nodes)")]
        if self.tokenizer is not None:
            try:
                vocabulary = len(self._tokenizer)
            except Exception as error:  # noqa: BLE001 - transformers raises several types for a bad directory
                return [Violation("data.tokenizer", self.tokenizer, f"cannot be loaded: {type(error).__name__}: "
                                  f"{str(error)[:300]}.", "point data.tokenizer at a local save_pretrained "
                                  "directory, or set data.tokenizer=null for byte tokens")]
            if vocabulary < 1:
                return [Violation("data.tokenizer", self.tokenizer, "has an empty vocabulary.",
                                  "point data.tokenizer at a trained tokenizer")]
        if self.seq_len < 1 or not 0 < self.val_fraction < 1:
            return []  # reported by the range checks
        train, val = self._estimated_sizes()
        if min(train, val) >= samples_per_step:
            return []
        return [Violation("data.files", self.files, f"too little text: about {train} training and {val} evaluation "
                          f"windows of data.seq_len + 1 = {self.seq_len + 1} tokens (estimated at one token per "
                          f"byte); each part needs {samples_per_step}.",
                          "add text, or lower data.seq_len or raise data.val_fraction")]

    def _missing_field(self, path: Path) -> Violation | None:
        kind = self._format(path)
        if kind == "parquet":
            import pyarrow.parquet as pq

            columns = pq.read_schema(path).names
        elif kind == "json":
            with open(path, encoding="utf-8") as handle:
                first = handle.readline()
            try:
                columns = list(json.loads(first)) if first.strip() else []
            except (json.JSONDecodeError, TypeError):
                return Violation("data.files", str(path), "its first line is not a JSON object.",
                                 "give one JSON object per line (.jsonl)")
        else:
            return None
        if self.text_field not in columns:
            return Violation("data.text_field", self.text_field, f"is not a field of {path} (it has: "
                             f"{', '.join(columns[:20])}).", "set data.text_field to the field holding the text")
        return None

    def _estimated_sizes(self) -> tuple[int, int]:
        total = sum(p.stat().st_size for p in self.paths)
        return self._split(max((total - 1) // self.seq_len, 0))

    def sizes(self) -> tuple[int, int]:
        return self._split(len(self._table()))

    def _split(self, windows: int) -> tuple[int, int]:
        n_val = int(windows * self.val_fraction)
        return windows - n_val, n_val

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch_size, self.seq_len)
        return (torch.zeros(shape, dtype=torch.long, device="meta"),
                torch.zeros(shape, dtype=torch.long, device="meta"))

    @cached_property
    def _cache_path(self) -> Path:
        digest = hashlib.sha256()
        for path in self.paths:
            stat = path.stat()
            digest.update(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
        digest.update(f"{self.text_field}|{self.tokenizer and Path(self.tokenizer).resolve()}|{self.seq_len}".encode())
        return Path(os.path.expanduser(self.cache_dir)) / digest.hexdigest()[:24]

    def prepare(self) -> None:
        """Tokenize and pack once: the first caller builds the cache under a lock, the rest wait for it.

        The lock file goes once the build ends, built or failed, and so does a half-written
        dataset: a failed tokenization leaves nothing in ``cache_dir``.
        """
        target = self._cache_path
        if (target / "done").exists():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        lock_path = Path(f"{target}.lock")
        with _exclusive(lock_path):
            try:
                if not (target / "done").exists():
                    self._build(target)
            finally:
                shutil.rmtree(target.with_name(target.name + ".building"), ignore_errors=True)
                lock_path.unlink(missing_ok=True)

    def _build(self, target: Path) -> None:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never ask a hub
        import datasets
        from datasets import load_dataset

        datasets.disable_progress_bars()

        tokenizer = self._tokenizer
        field = self.text_field
        raw = []
        for path in self.paths:
            kind = self._format(path)
            part = load_dataset(kind, data_files=str(path), split="train", keep_in_memory=False)
            column = "text" if kind == "text" else field
            raw.append(part.select_columns([column]).rename_column(column, "text") if column != "text"
                       else part.select_columns(["text"]))
        from datasets import concatenate_datasets

        texts = concatenate_datasets(raw) if len(raw) > 1 else raw[0]
        window = self.seq_len + 1

        def pack(batch: dict[str, list]) -> dict[str, list]:
            if tokenizer is None:
                ids = [list((text + "\n").encode("utf-8")) for text in batch["text"]]
            else:
                ids = tokenizer([text + "\n" for text in batch["text"]], add_special_tokens=False)["input_ids"]
            stream = [token for row in ids for token in row]
            # Windows share their edge token, as the byte corpus does: inputs of one end where the next start.
            count = max((len(stream) - 1) // self.seq_len, 0)
            return {"ids": [stream[i * self.seq_len: i * self.seq_len + window] for i in range(count)]}

        packed = texts.map(pack, batched=True, batch_size=4096, remove_columns=["text"],
                           desc="tokenizing and packing")
        building = target.with_name(target.name + ".building")
        packed.save_to_disk(str(building))
        if not target.exists():
            os.replace(building, target)
        (target / "done").write_text(json.dumps({"windows": len(packed)}))

    def _table(self):
        from datasets import load_from_disk

        self.prepare()
        return load_from_disk(str(self._cache_path))  # memory-mapped Arrow

    def datasets(self) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
        table = self._table()
        n_train, _ = self._split(len(table))
        return _Windows(table, 0, n_train), _Windows(table, n_train, len(table))

    def collate(self) -> Callable[[list], Any] | None:
        return None

    def describe(self) -> dict[str, Any]:
        digest, size = files_digest(self.paths)
        return {"name": self.paths[0].name if len(self.paths) == 1 else f"{len(self.paths)} files",
                "source": [str(p.resolve()) for p in self.paths], "size": size, "unit": "bytes", "digest": digest,
                "tokenizer": self.tokenizer or "bytes", "seq_len": self.seq_len}
