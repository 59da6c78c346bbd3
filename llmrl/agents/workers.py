"""Daemon worker threads for environment code (rewards, observations) that may hang.

`in_worker_thread` runs a call on one and gives the event loop a future of its result; the agent
awaits it under its timeout and abandons a call that never returns (`llmrl.agents.reward_only`).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable
from typing import Any


class DaemonWorkers:
    """Daemon threads for env calls, reused while idle (`idle_s`), started when none is free.

    A call that hangs keeps its thread, which is abandoned: later calls get other threads, and the
    interpreter never waits for it at exit (a shared executor would queue later calls behind a hung
    one, and join it at exit). Reusing threads matters because starting one per call costs more than
    a cheap reward such as the arithmetic one, and far more on a busy machine.
    """

    def __init__(self, idle_s: float = 30.0):
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # the inbox of each idle worker
        os.register_at_fork(after_in_child=self._forget_workers)  # a child process has none of them

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` (which must not raise) on an idle worker, or on a new one."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(inbox,), daemon=True, name="llmrl-env").start()
        inbox.put(job)

    def _work(self, inbox: queue.SimpleQueue) -> None:
        while True:
            try:
                job = inbox.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if any(idle is inbox for idle in self._idle):
                        self._idle = [idle for idle in self._idle if idle is not inbox]
                        return
                continue  # taken while timing out: its job is on the way
            job()
            with self._lock:
                self._idle.append(inbox)

    def _forget_workers(self) -> None:
        self._lock = threading.Lock()
        self._idle = []


_ENV_WORKERS = DaemonWorkers()


def in_worker_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Run `fn(*args)` on a daemon worker thread; a call that hangs is abandoned, not waited for."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled by a timeout
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def job() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting coroutine
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while we ran: nobody is waiting any more
            pass

    _ENV_WORKERS.submit(job)
    return future
