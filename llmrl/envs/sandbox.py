"""Run untrusted Python (model-written code) in a separate, limited process.

`run(code, timeout_s=..., memory_mb=...)` writes the code to a fresh temporary directory and runs
it with ``python -I -S`` (isolated mode, standard library only) behind these layers:

1. **Always** (any POSIX system):
   - its own session and process group; on timeout, and after every run, the whole group is
     killed with SIGKILL, so forked children do not outlive it;
   - resource limits set before the code starts: CPU seconds (RLIMIT_CPU), address space
     (RLIMIT_AS = `memory_mb`), size of any file written (RLIMIT_FSIZE, which also bounds the
     captured stdout/stderr, as they are files), open files (RLIMIT_NOFILE), no core dumps, and
     processes (RLIMIT_NPROC; the kernel ignores it for root, see 2);
   - the working directory, HOME and TMPDIR are the temporary directory; the environment is
     replaced by a minimal one (PATH, LANG), so no secret of the parent is inherited;
   - a Python audit hook (PEP 578), installed before the code runs and impossible to remove,
     refuses sockets, subprocesses and exec, signals to other processes, ctypes (which could call
     libc around the hook), writes, renames and deletions outside the temporary directory, and
     reads of other processes' /proc entries (where their environments are).
2. **When running as root with util-linux `unshare`** (our containers and CI): the process starts
   in new network and PID namespaces (``unshare --net --pid --fork --kill-child``): it has no
   network interface at all (not even a working loopback), and every process it forks dies with
   it, even one that left the process group with setsid(). Before running the code it drops to
   the unprivileged user `nobody` (uid 65534), so RLIMIT_NPROC applies (fork bombs stop at
   `max_processes`) and file permissions keep it out of root's files.

Without root the kernel-level network block and the PID namespace are missing: the audit hook
still refuses sockets, and after the group kill a sweep of /proc kills any process still carrying
the run's unique directory in its command line (children that left the group with setsid()).
`isolation()` says which layers are active. The hook is a Python-level guard: code that found a way to run
native code without ctypes could bypass it; the kernel layers are what bounds the damage then.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID = 65534
"""`nobody`: the user the code runs as when the parent is root."""

_NAMESPACES = ["unshare", "--net", "--pid", "--fork", "--kill-child"]


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run did."""

    returncode: int
    """Exit status; negative for a signal (-9 when killed on timeout)."""
    stdout: str
    stderr: str
    timed_out: bool
    """True when the wall-clock limit ended the run."""
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# The trusted prelude, run with `python -I -S -c`: limits, privileges and the audit hook, then
# the untrusted main.py. argv: work dir, cpu seconds, memory bytes, file bytes, processes, uid.
_RUNNER = r"""
import os, resource, sys

work = sys.argv[1]
cpu_s, memory_bytes, file_bytes, max_processes, uid = (int(v) for v in sys.argv[2:7])

def limit(kind, value):
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):  # not supported on this platform
        pass

limit(resource.RLIMIT_CPU, cpu_s)
limit(resource.RLIMIT_AS, memory_bytes)
limit(resource.RLIMIT_FSIZE, file_bytes)
limit(resource.RLIMIT_NOFILE, 64)
limit(resource.RLIMIT_CORE, 0)
if uid >= 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
limit(resource.RLIMIT_NPROC, max_processes)
os.chdir(work)

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
BLOCKED = frozenset({
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile", "pty.spawn",
    "os.kill", "os.killpg", "signal.pthread_kill",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "ctypes.addressof",
})
PATH_EVENTS = frozenset({
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.chflags", "os.link",
    "os.symlink", "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "shutil.rmtree",
    "shutil.copyfile", "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.move", "shutil.chown",
})
realpath, fsdecode, getpid = os.path.realpath, os.fsdecode, os.getpid

def inside(path):
    p = realpath(fsdecode(path))
    return p == work or p.startswith(work + "/") or p == "/dev/null"

def refuse(event, detail=""):
    raise PermissionError(f"sandbox: {event} {detail}".strip())

def audit(event, args):
    if event == "open":
        path, mode, flags = args
        if not isinstance(path, (str, bytes)):
            return
        writing = (mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & WRITE_FLAGS
        if writing and not inside(path):
            refuse("writing outside the sandbox directory:", fsdecode(path))
        parts = realpath(fsdecode(path)).split("/")
        if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and int(parts[2]) != getpid():
            refuse("reading another process:", fsdecode(path))
    elif event.startswith("socket.") or event in BLOCKED:
        refuse(event, "is not allowed")
    elif event in PATH_EVENTS:
        for arg in args:
            if isinstance(arg, (str, bytes)) and not inside(arg):
                refuse(event, "outside the sandbox directory: " + fsdecode(arg))

with open("main.py", encoding="utf-8") as f:
    source = f.read()
program = compile(source, "main.py", "exec")
sys.argv = ["main.py"]
sys.addaudithook(audit)
del f, source, limit, resource
exec(program, {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class _Launcher:
    """How this machine starts a sandboxed interpreter (probed once)."""

    prefix: tuple[str, ...]
    interpreter: str
    uid: int  # -1: keep the current user


def _namespace_prefix() -> tuple[str, ...]:
    """The unshare command line when this process may create namespaces, else nothing."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return ()
    try:
        probe = subprocess.run([*_NAMESPACES, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(_NAMESPACES) if probe.returncode == 0 else ()


@functools.lru_cache(maxsize=1)
def _launcher() -> _Launcher:
    prefix = _namespace_prefix()
    if os.geteuid() != 0:
        return _Launcher(prefix, sys.executable, -1)
    # `nobody` must be able to read the interpreter's standard library; ours may live under a
    # private home directory (pyenv in /root), so fall back to a system Python 3 that it can read.
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system_path = "/usr/local/bin:/usr/bin:/bin"
    candidates = [
        sys.executable,
        shutil.which(version, path=system_path),
        shutil.which("python3", path=system_path),
    ]
    for interpreter in dict.fromkeys(c for c in candidates if c):
        launcher = _Launcher(prefix, interpreter, SANDBOX_UID)
        if _execute(launcher, "import json, re, collections", timeout_s=10.0, memory_mb=512).ok:
            return launcher
    return _Launcher(prefix, sys.executable, -1)


def isolation() -> dict[str, bool | str]:
    """Which layers `run` uses on this machine, and the interpreter it runs."""
    launcher = _launcher()
    return {
        "process_group_kill": True,
        "resource_limits": True,
        "scrubbed_environment": True,
        "audit_hook": True,
        "network_namespace": bool(launcher.prefix),
        "pid_namespace": bool(launcher.prefix),
        "unprivileged_user": launcher.uid >= 0,
        "interpreter": launcher.interpreter,
    }


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _sweep(marker: str) -> None:
    """Kill every process whose command line holds `marker` (our unique work dir).

    Without a PID namespace this catches children that left the process group with setsid();
    forks keep their parent's command line, and exec is refused by the audit hook.
    """
    needle = marker.encode()
    for _ in range(10):  # a fork bomb may still be forking while we sweep
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if needle not in f.read():
                        continue
                os.kill(int(entry.name), signal.SIGKILL)
                found = True
            except OSError:  # gone already, or not ours
                continue
        if not found:
            return


def check_limits(*, timeout_s: float, memory_mb: int, max_processes: int = 1, max_file_mb: int = 1) -> None:
    """Raise ValueError for limits no run could work under."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb < 64:
        raise ValueError(f"memory_mb must be >= 64 (the interpreter needs some), got {memory_mb}")
    if max_processes < 1 or max_file_mb < 1:
        raise ValueError(f"max_processes and max_file_mb must be >= 1, got {max_processes} and {max_file_mb}")


def run(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_processes: int = 32,
    max_file_mb: int = 16,
) -> SandboxResult:
    """Run `code` as a Python program in the sandbox, `stdin` as its input; never raises for anything
    the code does. The input is a file outside the code's folder, readable only through stdin."""
    check_limits(
        timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes, max_file_mb=max_file_mb
    )
    return _execute(
        _launcher(),
        code,
        stdin=stdin,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_processes=max_processes,
        max_file_mb=max_file_mb,
    )


def _execute(
    launcher: _Launcher,
    code: str,
    *,
    stdin: str = "",
    timeout_s: float,
    memory_mb: int,
    max_processes: int = 32,
    max_file_mb: int = 16,
) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="llmrl-sandbox-", ignore_cleanup_errors=True) as root:
        work = Path(root, "work")
        work.mkdir()
        (work / "main.py").write_text(code, encoding="utf-8")
        if launcher.uid >= 0:
            os.chmod(root, 0o711)  # `nobody` may pass through to work/, not list or touch the outputs
            os.chown(work, launcher.uid, launcher.uid)
        limits = [math.ceil(timeout_s) + 1, memory_mb << 20, max_file_mb << 20, max_processes, launcher.uid]
        command = [
            *launcher.prefix,
            launcher.interpreter,
            "-I",
            "-S",
            "-B",
            "-c",
            _RUNNER,
            str(work),
            *map(str, limits),
        ]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
        in_path, out_path, err_path = Path(root, "stdin"), Path(root, "stdout"), Path(root, "stderr")
        in_path.write_text(stdin, encoding="utf-8")
        start = time.monotonic()
        with open(in_path, "rb") as given, open(out_path, "wb") as out, open(err_path, "wb") as err:
            process = subprocess.Popen(
                command,
                cwd=work,
                env=env,
                stdin=given,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            try:
                process.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(process.pid)  # also ends children left running after a normal exit
                returncode = process.wait()
                if not launcher.prefix and os.path.isdir("/proc"):
                    _sweep(str(work))
        duration = time.monotonic() - start
        limit = max_file_mb << 20
        stdout = out_path.read_bytes()[:limit].decode("utf-8", errors="replace")
        stderr = err_path.read_bytes()[:limit].decode("utf-8", errors="replace")
    return SandboxResult(
        returncode=returncode, stdout=stdout, stderr=stderr, timed_out=timed_out, duration_s=duration
    )
