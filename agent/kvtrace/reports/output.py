"""A report's file appears whole or not at all.

Every file kvtrace writes for a viewer (a Perfetto trace, a memory-viz pickle, a flame graph) goes to a
temporary file in the same directory first and is renamed over its name once complete, so a crash, a
full disk or Ctrl-C never leaves half a file where a viewer would open it.
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

T = TypeVar("T")


def write_whole(path: str | os.PathLike[str], write: Callable[[BinaryIO], T], what: str, example_name: str,
                mode: int = 0o666) -> T:
    """Calls `write(file)` on a temporary file next to `path`, then renames it to `path`; returns what
    `write` returned. `mode` is before the umask (0666: what a plain open() gives). A directory at
    `path` is refused, naming `what` and an `example_name` to use instead."""
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a directory: give the {what} a file name, e.g. {target / example_name}")
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(descriptor, "wb") as file:
            result = write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        # Whatever stopped it (a full disk, a value the writer refuses, Ctrl-C): no temporary is left.
        temporary.unlink(missing_ok=True)
        raise
    return result
