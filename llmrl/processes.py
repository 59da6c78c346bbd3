"""The local processes llmrl starts (servers, rendezvous), the ports they listen on, and the server
processes that never outlive the trainer: each is stopped on request, at interpreter exit, or when the
thread that started it dies (Linux's parent-death signal), with its whole session."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

_LOG_TAIL_LINES = 30
_at_exit: dict[int, Callable[[], None]] = {}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now (for a server to bind, or a rendezvous)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


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


class ServerStartError(RuntimeError):
    """A server process llmrl owns could not be started (the message ends with its log's last lines)."""


class ServerProcess:
    """One HTTP server process that llmrl owns, logging to `log_path`: ready once `health_route` answers
    200, stopped (with every process it started) on `stop`, at interpreter exit, or when this process
    dies. Subclasses give its `command` and `environment`."""

    start_error: type[ServerStartError] = ServerStartError
    """What `wait_ready` raises."""

    def __init__(
        self,
        *,
        name: str,
        host: str,
        port: int,
        log_path: Path,
        health_route: str,
        startup_timeout_s: float,
        timeout_field: str,
    ):
        """`name`: the server in the errors' words; `timeout_field`: the config field of
        `startup_timeout_s`, which the error of a server that never answers names."""
        self.name = name
        self.host = host
        self.port = port
        self.log_path = log_path
        self.health_route = health_route
        self.startup_timeout_s = startup_timeout_s
        self.timeout_field = timeout_field
        self.process: subprocess.Popen[bytes] | None = None
        # A child dies with the thread that started it (PR_SET_PDEATHSIG), so every start runs on
        # this one thread, which lives as long as the server object.
        self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="server-launcher")

    @property
    def root_url(self) -> str:
        """Where the server answers, without an API prefix (a wildcard bind is reached on loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self) -> None:
        """Start the process and wait until it answers its health route (`start_error` otherwise)."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start the process without waiting for it (`wait_ready` waits)."""
        self._launcher.submit(self._spawn).result()
        stop_at_exit(id(self), self.close)

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== llmrl: starting {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(base_url=self.root_url, timeout=5) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise self.start_error(
                        f"{self.name} on port {self.port} exited while starting{self._log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.health_route).status_code == 200:
                        return
                time.sleep(0.5)
        self.stop()
        raise self.start_error(
            f"{self.name} on port {self.port} did not answer {self.health_route} within "
            f"{self.timeout_field}={self.startup_timeout_s:g} s{self._log_tail()}"
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_description(self) -> str:
        """How the process ended ('it is running' while it runs)."""
        code = self.process.poll() if self.process is not None else None
        if self.process is None:
            return "it was stopped"
        if code is None:
            return f"it is running but does not answer {self.health_route}"
        if code < 0:
            return f"it was killed by {signal.Signals(-code).name}"
        return f"it exited with status {code}"

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server and every process in its session (its engine and workers)."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                process.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        kill_session_leftovers(process.pid)

    def close(self) -> None:
        self.stop()
        self._launcher.shutdown(wait=False)
        forget(id(self))

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        except OSError:
            return ""
        return f" (log: {self.log_path}); its last lines:\n" + "\n".join(lines)
