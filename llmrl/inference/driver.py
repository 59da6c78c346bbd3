"""RequestDriver: an engine's requests and the work between its steps, in order, from any thread.

The embedded engine (`engine.LocalEngine`) and colocated vLLM (`vllm.colocated.ColocatedVLLM`) drive
their batches alike; each gives the driver its own primitives (`EngineSteps`: which queued requests
join the next step, the step, ending or failing the running requests), and the driver holds the rest:

* **Requests** queue from any thread (`submit`), each with the future its caller waits on, and join
  the batch in the order they came, as many as the engine's `admit` takes.
* **Work between steps** (`between_steps`: a weight update, sleep) runs between two steps, in the
  order it came; while any waits, no request joins. `weight_update` decides the running requests'
  fate: ``wait`` lets them finish first, ``abort`` ends them at once, ``in_flight`` runs the work at
  once and they go on. With nobody stepping, the work runs in its caller's thread.
* **Failures**: a step that raises fails the requests in it, and the engine goes on serving. Once
  `close`d, every request and work item left fails and more are refused (one-line messages).
* **Who steps**: the embedded engine steps on the event loop of the caller that finds nobody
  stepping (why: `engine.py`), a task that ends once idle, handing over to a thread if the loop closes
  with work left; colocated vLLM steps on a thread of its own (`own_thread`), which sleeps while idle.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from llmrl.inference.interface import running_loop

WeightUpdateMode = Literal["wait", "abort", "in_flight"]


class Queued(Protocol):
    future: Future[Any]


R = TypeVar("R", bound=Queued)


def _nothing() -> None:
    return None


def _everything(waiting: deque[R]) -> list[R]:
    admitted = list(waiting)
    waiting.clear()
    return admitted


@dataclass(frozen=True)
class EngineSteps(Generic[R]):
    """An engine's primitives, called by whoever steps, one at a time (`admit`, `drop_cancelled` and
    `release` under the driver's lock, so that no request or work joins meanwhile)."""

    running: Callable[[], bool]
    """Whether any admitted request is still running."""
    step: Callable[[list[R]], None]
    """One engine step, with the requests `admit` just took."""
    abort_running: Callable[[], None]
    """Ends every running request now, each answered with ``finish_reason: abort``."""
    fail_running: Callable[[list[R], Exception], None]
    """A step raised: fails the running requests and those just admitted with the error."""
    admit: Callable[[deque[R]], list[R]] = _everything
    """Takes from the front of the queue the requests that join the next step; by default all of them
    (an engine that schedules its requests itself)."""
    drop_cancelled: Callable[[], None] = _nothing
    """Before each round: lets go of running requests whose callers gave up."""
    release: Callable[[], None] = _nothing
    """Nothing runs or waits, and the stepping task ends: free what an empty batch does not need."""


@dataclass(eq=False)
class _Stepper:
    """Whoever steps: a task on an event loop (`loop` set) or a thread."""

    loop: asyncio.AbstractEventLoop | None = None
    task: asyncio.Task | None = None
    thread: threading.Thread | None = None


@dataclass(eq=False)
class _Work:
    run: Callable[[], Any]
    done: Future[Any] = field(default_factory=Future)


class RequestDriver(Generic[R]):
    """Queues an engine's requests and work, and steps it (see the module docstring)."""

    def __init__(
        self,
        engine: EngineSteps[R],
        *,
        name: str,
        thread_name: str,
        weight_update: WeightUpdateMode,
        own_thread: bool = False,
    ):
        """
        Args:
            engine: the engine's primitives.
            name: the engine in messages (``"the colocated vLLM engine"``).
            thread_name: the name of the threads that step it.
            weight_update: what work between steps does with running requests (`wait`, `abort`,
                `in_flight`).
            own_thread: step on a thread of the driver's own, for its whole life, rather than on
                callers' event loops.
        """
        self.engine = engine
        self.name = name
        self.thread_name = thread_name
        self.weight_update = weight_update
        self._lock = threading.Condition()  # guards the queue, the work, the stepper and `_closed`
        self._waiting: deque[R] = deque()
        self._work: deque[_Work] = deque()
        self._closed = False
        self._stepper: _Stepper | None = None
        self._own_thread = own_thread
        if own_thread:
            self._stepper = stepper = _Stepper()
            stepper.thread = threading.Thread(
                target=self._step_in_own_thread, args=(stepper,), name=thread_name, daemon=True
            )
            stepper.thread.start()

    @property
    def queued(self) -> int:
        """Requests waiting to join the batch."""
        return len(self._waiting)

    @property
    def stepping(self) -> bool:
        """Whether a task or thread steps the engine now."""
        return self._stepper is not None

    def submit(self, request: R) -> None:
        """Queue `request`; from a coroutine, its loop steps the engine when nobody does."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            self._waiting.append(request)
            if self._stepper is None:
                loop = asyncio.get_running_loop()
                self._stepper = stepper = _Stepper(loop)
                stepper.task = loop.create_task(self._step_in_loop(stepper))
            self._lock.notify()

    def between_steps(self, run: Callable[[], Any]) -> Any:
        """Run `run` between two steps (as `weight_update` says) and return its result or raise its error."""
        work = _Work(run)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            stepper = self._stepper
            if stepper is None:  # nobody steps: now, holding the lock so that no step starts
                settle(work.done, run)
            else:
                self._work.append(work)
                self._lock.notify()
        if stepper is not None and stepper.loop is not None and stepper.loop is running_loop():
            # Called from a coroutine of the loop that steps: that loop is blocked here, so step from here.
            while not work.done.done() and self._round(stepper):
                pass
        return work.done.result()

    def close(self) -> bool:
        """Fail what is left, refuse more, and wait for the driver's own thread to end; False when it
        was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            stepper = self._stepper
            self._lock.notify()
        if stepper is not None and stepper.thread is not None:
            stepper.thread.join()
        return True

    # -- stepping --------------------------------------------------------------------------------

    async def _step_in_loop(self, stepper: _Stepper) -> None:
        try:
            while self._round(stepper):
                await asyncio.sleep(0)  # let agents run (and submit) between steps
        except asyncio.CancelledError:
            # The loop is shutting down: hand the remaining work to a thread.
            with self._lock:
                if self._stepper is stepper:
                    self._stepper = None
                    if self._waiting or self.engine.running() or self._work:
                        self._start_thread()
            raise

    def _start_thread(self) -> None:
        """Lock held. Not a daemon: at exit Python waits for it (it ends once idle), rather than
        killing it inside a torch kernel."""
        self._stepper = stepper = _Stepper()
        stepper.thread = threading.Thread(target=self._step_in_thread, args=(stepper,), name=self.thread_name)
        stepper.thread.start()

    def _step_in_thread(self, stepper: _Stepper) -> None:
        while self._round(stepper):
            pass

    def _step_in_own_thread(self, stepper: _Stepper) -> None:
        while True:
            with self._lock:
                while not (self._waiting or self._work or self.engine.running() or self._closed):
                    self._lock.wait()
            if not self._round(stepper):
                return

    def _round(self, stepper: _Stepper) -> bool:
        """Drop cancelled requests, run due work, admit, step; False once `stepper` has nothing left to
        do (but on its own thread, until closed) or was replaced."""
        admitted: list[R] = []
        try:
            with self._lock:
                if self._stepper is not stepper:
                    return False
                if self._closed:
                    self._stepper = None
                    self._fail_all(RuntimeError(f"{self.name} was closed"))
                    return False
                self.engine.drop_cancelled()
                work = self._due_work()
            if work:
                self._run(work)
            with self._lock:
                if self._waiting and not self._work:
                    admitted = self.engine.admit(self._waiting)
                if not admitted and not self.engine.running():
                    if self._waiting or self._work or self._own_thread:
                        return True  # work came meanwhile, or the own thread waits for some
                    self._stepper = None
                    self.engine.release()
                    return False
            self.engine.step(admitted)
        except Exception as exc:  # noqa: BLE001 - a failed step fails its batch, not the engine
            self.engine.fail_running(admitted, exc)
        return True

    def _due_work(self) -> list[_Work]:
        """Lock held: the work to run before this round's step (none while ``wait`` lets requests finish)."""
        if not self._work or (self.weight_update == "wait" and self.engine.running()):
            return []
        work, self._work = list(self._work), deque()
        return work

    def _run(self, work: list[_Work]) -> None:
        if self.weight_update == "abort" and self.engine.running():
            self.engine.abort_running()
        for item in work:
            settle(item.done, item.run)

    def _fail_all(self, error: Exception) -> None:
        """Lock held: the engine is gone; fail every request and work item with `error`."""
        self.engine.fail_running([], error)
        waiting, self._waiting = list(self._waiting), deque()
        work, self._work = list(self._work), deque()
        for request in waiting:
            if not request.future.done():
                request.future.set_exception(error)
        for item in work:
            item.done.set_exception(error)


def settle(future: Future[Any], compute: Callable[[], Any]) -> None:
    """Set `future` to what `compute` returns or raises, unless its caller cancelled it."""
    if future.cancelled():
        return
    try:
        future.set_result(compute())
    except BaseException as exc:  # noqa: BLE001 (the caller waiting on the future gets it)
        future.set_exception(exc)
