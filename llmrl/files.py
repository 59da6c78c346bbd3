"""Files and folders that readers never see half-written: written under a temporary name beside their
place, then renamed into it (a rename within one file system is atomic); and the OS error behind a
failed write, however the writer reported it."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def _beside(path: Path, tag: str) -> Path:
    """A fresh hidden name in `path`'s folder (so a rename to `path` never crosses file systems)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.{tag}")


def move_into_place(written: Path, path: Path) -> None:
    """Rename the complete file or folder `written` (in `path`'s folder) to `path`, replacing what is there.

    A folder in the way cannot be renamed over: it is renamed aside first and removed after, so
    `path` is without a complete copy only between two renames.
    """
    if written.is_dir() and path.is_dir():
        retired = _beside(path, "retired")
        os.replace(path, retired)
        os.replace(written, path)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(written, path)


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write a file or folder at: when the block ends it replaces
    `path` (`move_into_place`); when the block raises it is removed and `path` is left as it was."""
    path = Path(path)
    temp = _beside(path, "tmp")
    try:
        yield temp
        move_into_place(temp, path)
    finally:
        if temp.is_dir():
            shutil.rmtree(temp, ignore_errors=True)
        else:
            temp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary file, readable by all (0644) like other run outputs."""
    with replacing(path) as temp:
        temp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(temp, 0o644)


_NATIVE_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How writers in Rust (safetensors, tokenizers) end the message of an OS error."""


def os_error_behind(exc: BaseException) -> OSError | None:
    """The OS error a failure comes from, if any: `exc` itself, one it was raised while handling (torch
    writing through a Python file reports a short write so), or one a native writer names in its
    message ("... No space left on device (os error 28)")."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        match = _NATIVE_OS_ERROR.search(str(current))
        if match:
            number = int(match.group(1))
            return OSError(number, os.strerror(number))
        current = current.__cause__ or current.__context__
    return None


def describe_os_error(error: OSError) -> str:
    """The error's number and reason without its file name: ``Errno 30 read-only file system``."""
    return f"Errno {error.errno} {(error.strerror or os.strerror(error.errno or 0)).lower()}"
