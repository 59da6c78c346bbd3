"""Who may write a run folder, and what a run says when it cannot.

**One live run per folder**: ``RUN_DIR/run.lock``, held for as long as a run trains there
(`RunLock`). A run takes it before it reads or writes anything else in the folder; a second run into
it stops at once with `RunFolderInUseError`, naming the live one (pid, host, since when), from what
the lock file holds. The hold is an exclusive `flock` on the open file, so the operating system drops
it whenever the process ends, however it ends (SIGKILL, a crash, the machine's restart): a lock file
left behind by a dead run holds no lock, and the next run takes it over. A run that ends removes the
file (and the folders it created for it, when nothing else was written there). The lock belongs to
the process: a second `Trainer` of the same folder in one Python process shares it (the hold ends
with the last one). Under ``torchrun`` rank 0 holds it for all ranks.

**Writes that fail** (a full disk, a read-only file system) stop the run with one line,
`RunFolderWriteError` (`write_failure`): what could not be written, the OS error, and the checkpoint
that the same command resumes from, which the failed write left as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from llmrl.errors import UserError
from llmrl.files import describe_os_error
from llmrl.trainer.checkpoint import latest_checkpoint

LOCK_FILE = "run.lock"


class RunFolderInUseError(UserError):
    """Another live process trains in the run folder."""


class RunFolderNotWritableError(UserError):
    """The run folder cannot be created or written at the start (a read-only file system, no permission)."""


class RunFolderWriteError(Exception):
    """The run folder could not be written while the run trained: the machine failed, not the user."""


def write_failure(what: str, error: OSError, run_dir: Path) -> RunFolderWriteError:
    """The error that stops a run which could not write `what` (`error`): it says what the run folder
    keeps and what the same command does once the folder can be written again."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        kept = f"{run_dir} has no earlier checkpoint: once it can be written, the same command starts over"
    else:
        kept = (
            f"kept: the checkpoint of step {latest[0]} and the rollout bank; once {run_dir} can be "
            f"written, the same command resumes from step {latest[0]}"
        )
    return RunFolderWriteError(f"cannot write {what} ({describe_os_error(error)}); {kept}")


@dataclass
class _Hold:
    """This process's flock on one run folder's lock file, and how many `RunLock`s share it."""

    descriptor: int
    created: list[Path]
    """The folders made to hold the lock file, deepest first: removed at release when empty."""
    holders: int = 1


_holds: dict[Path, _Hold] = {}
_holds_guard = threading.Lock()


class RunLock:
    """This process's hold on `run_dir` (see the module docstring); `release()` ends it."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._key = self.run_dir.resolve()
        self._released = False
        with _holds_guard:
            hold = _holds.get(self._key)
            if hold is not None:
                hold.holders += 1
            else:
                _holds[self._key] = self._take()

    def release(self) -> None:
        """End this hold (again: nothing); the last in the process removes the lock file and unlocks."""
        with _holds_guard:
            if self._released:
                return
            self._released = True
            hold = _holds[self._key]
            hold.holders -= 1
            if hold.holders:
                return
            del _holds[self._key]
            # Removed while still locked: a run that opens the file after this finds it gone (`_take`).
            with contextlib.suppress(OSError):  # a folder no longer writable keeps it, unlocked
                self.path.unlink(missing_ok=True)
            os.close(hold.descriptor)
            for folder in hold.created:
                with contextlib.suppress(OSError):  # something else was written there: it stays
                    folder.rmdir()

    def _take(self) -> _Hold:
        created = _missing_folders(self.run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            descriptor = self._lock_file()
            try:
                os.ftruncate(descriptor, 0)
                os.pwrite(descriptor, _holder_record().encode(), 0)
            except OSError:
                os.close(descriptor)
                raise
        except OSError as exc:
            raise RunFolderNotWritableError(
                f"run_dir: {self.run_dir} is not writable ({describe_os_error(exc)})"
            ) from None
        return _Hold(descriptor, created)

    def _lock_file(self) -> int:
        """The lock file, open and locked by this process."""
        while True:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(descriptor, 4096, 0)
                os.close(descriptor)
                raise RunFolderInUseError(_in_use_message(self.run_dir, holder)) from None
            if _is_current(descriptor, self.path):
                return descriptor
            os.close(descriptor)  # removed by a run that ended meanwhile: the next open makes a new one


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _is_current(descriptor: int, path: Path) -> bool:
    """Whether the locked file is still the one at `path`."""
    try:
        return os.stat(path).st_ino == os.fstat(descriptor).st_ino
    except FileNotFoundError:
        return False


def _holder_record() -> str:
    since = datetime.now().astimezone().isoformat(timespec="seconds")
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}) + "\n"


def _in_use_message(run_dir: Path, record: bytes) -> str:
    try:
        holder = json.loads(record)
        who = f"pid {holder['pid']} on {holder['host']}, since {holder['since']}"
    except (ValueError, KeyError, TypeError):  # the live run has opened the file but not written it yet
        who = "just starting: its pid is not written yet"
    return (
        f"run_dir {run_dir} is in use by a live run ({who}); wait for it to end, stop it, "
        "or choose another run_dir"
    )
