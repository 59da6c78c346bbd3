"""Server processes that never outlive the trainer: each is stopped on request, at interpreter exit,
or when the thread that started it dies (Linux's parent-death signal), with its whole session."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
from collections.abc import Callable
from pathlib import Path

_at_exit: dict[int, Callable[[], None]] = {}


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the thread that started it dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def kill_session_leftovers(session_id: int) -> None:
    """SIGKILL what is left of a process session (a worker that outlived its parent)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session_id:  # the session id field
                os.kill(int(entry.name), signal.SIGKILL)


def stop_at_exit(key: int, stop: Callable[[], None]) -> None:
    """Call `stop` when the interpreter exits, unless `forget(key)` comes first."""
    _at_exit[key] = stop


def forget(key: int) -> None:
    _at_exit.pop(key, None)


@atexit.register
def _stop_all() -> None:
    for stop in list(_at_exit.values()):
        stop()
