"""Every row of a text or JSON-lines file read once, as the tokenizer will read it, before any worker does.

A file whose first rows are fine can still fail the run far in: a Latin-1 byte in a ``.txt``
(read as UTF-8), a JSON row without the text field or with a non-string in it. The workers would
then fail with exit 1 and a tokenizer's traceback; read here, the problem is an input error
naming the file and the line. The file is streamed line by line through ``pyarrow.fs`` (local
paths and object-store URIs alike, ``.gz`` decompressed), so no file is held in memory.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Literal

READ_BUFFER = 1 << 20
"""Bytes read from the file at a time."""


@dataclass(frozen=True)
class BadRow:
    """The first row of a file that the tokenizer could not read."""

    line: int
    """1-based line number in the (decompressed) file."""
    problem: str
    """What is wrong with it, in words."""
    fix: str
    """What to change."""


def first_bad_row(location: str, kind: Literal["text", "json"], text_field: str) -> BadRow | None:
    """The first line of ``location`` that is not UTF-8 text (``kind="text"``) or not a JSON object
    holding a string under ``text_field`` (``kind="json"``; blank lines are skipped, as the readers
    skip them); None when every line is fine."""
    from orch.workloads.ray_data import _filesystem

    fs, inner = _filesystem(location)
    with fs.open_input_stream(inner, compression="detect") as native, \
            io.BufferedReader(native, buffer_size=READ_BUFFER) as lines:
        for number, raw in enumerate(lines, 1):
            problem = _text_problem(raw) if kind == "text" else _json_problem(raw, text_field)
            if problem:
                return BadRow(number, *problem)
    return None


def _text_problem(raw: bytes) -> tuple[str, str] | None:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return (f"is not UTF-8 (byte 0x{raw[error.start]:02x} at column {error.start + 1}; the text is read as "
                "UTF-8).", "convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8`)")
    return None


def _json_problem(raw: bytes, text_field: str) -> tuple[str, str] | None:
    if not raw.strip():
        return None
    try:
        row = json.loads(raw)
    except UnicodeDecodeError as error:
        return f"is not UTF-8 ({error.reason}).", "convert the file to UTF-8"
    except json.JSONDecodeError as error:
        return f"is not JSON ({error.msg}).", "give one JSON object per line (.jsonl)"
    if not isinstance(row, dict):
        return f"is a JSON {type(row).__name__}, not an object.", "give one JSON object per line (.jsonl)"
    if text_field not in row:
        keys = ", ".join(list(row)[:20])
        return (f"has no {text_field!r} field (data.text_field; it has: {keys}).",
                "give every row the text field, or remove the rows without it")
    if not isinstance(row[text_field], str):
        return (f"holds {type(row[text_field]).__name__} {str(row[text_field])[:40]!r}, not text, in its "
                f"{text_field!r} field.", "give every row a string in the text field")
    return None
