"""Why a local path that was named cannot be opened, in the words a fix needs."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def missing_reason(path: str | os.PathLike) -> str | None:
    """None when ``path`` exists (a symbolic link followed to its end); otherwise why not: no such
    file, a symbolic link loop, or a link to something that does not exist. ``Path.exists()``
    answers False for all three alike."""
    try:
        os.stat(path)
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return f"is a symbolic link loop ({path} -> {os.readlink(path)} never ends at a file)."
        if Path(path).is_symlink():
            return f"is a symbolic link to {os.readlink(path)}, which does not exist."
        if error.errno == errno.ENOENT:
            return "no such file or directory."
        return f"cannot be reached: {error.strerror}."
