"""Stopping a run on a signal: the exceptions that carry the signal to the command's exit status, and
the one place where a step may be abandoned rather than finished.

The trainer turns SIGINT (Ctrl-C), SIGTERM (what SLURM, Kubernetes and ``docker stop`` send) and SIGHUP
into a stop (`llmrl.trainer.trainer`): the step in flight finishes, or with ``checkpoint.on_signal:
save_now`` it is abandoned while it still waits for its rollouts (`abandonable`), a checkpoint is saved,
and the command exits with 128 + the signal's number, the status a shell reports for a process that
signal killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StoppedBySignal(KeyboardInterrupt):
    """The run stopped on the signal `signum`. A `KeyboardInterrupt`, as Ctrl-C's stop always was: code
    that cleans up after an `Exception` lets it through, and so does an asyncio event loop (a batch is
    drawn in one)."""

    def __init__(self, signum: int):
        super().__init__(signum)  # the argument also makes it picklable, for the broadcast under torchrun
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """What a shell reports for a process the signal killed: 130 for SIGINT, 143 for SIGTERM, 129
        for SIGHUP."""
        return 128 + self.signum


class StepAbandoned(StoppedBySignal):
    """A stop with ``checkpoint.on_signal: save_now`` came while the step in flight waited for its
    rollouts: nothing of the step has changed the run's state, and the last finished step is saved.
    Under torchrun rank 0 broadcasts it in place of the batch, so that every rank abandons that step."""


_waiting = threading.Event()  # the main thread waits in `abandonable`
_abandoning: list[int] = []  # the signal of a stop that abandons the step waiting, once one came


@contextlib.contextmanager
def abandonable() -> Iterator[None]:
    """Mark where the trainer's thread waits for a step's rollouts, before anything of the step has
    changed the run's state: a stop that abandons steps (`stop_abandons_steps`) raises `StepAbandoned`
    here, whether it comes during the wait or came before it. Signals are handled on the main thread
    alone: on other threads this marks nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _abandoning:
        raise StepAbandoned(_abandoning[0])
    _waiting.set()
    try:
        yield
    except asyncio.CancelledError:
        if not _abandoning:
            raise
    finally:
        _waiting.clear()
    if _abandoning:  # it came while an event loop ran here: the loop's tasks were cancelled, and ended
        raise StepAbandoned(_abandoning[0])


@contextlib.contextmanager
def stop_abandons_steps() -> Iterator[Callable[[int], None]]:
    """For a run with ``checkpoint.on_signal: save_now``: yields `abandon(signum)`, which its signal
    handler calls on a stop. When the trainer's thread waits in `abandonable` it ends the wait at once
    (raising `StepAbandoned`, or cancelling the event loop that runs there, whose end raises it), and
    otherwise makes the next such wait raise it (a step already training finishes, and the stop after
    it comes first). Signals are the process's, and so is this state: it is cleared when the run ends."""

    def abandon(signum: int) -> None:
        _abandoning.append(signum)
        if not _waiting.is_set():
            return
        _waiting.clear()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a plain wait (a future, a condition): nothing is left half done
            raise StepAbandoned(signum) from None
        # An exception raised here, at whatever line the loop's tasks are, would leave them half run
        # (context managers torn mid-exit): they are cancelled instead, as asyncio.run does on Ctrl-C,
        # and `abandonable` raises once they have ended.
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.call_soon_threadsafe(lambda: None)  # wakes the loop if it waits in select()

    try:
        yield abandon
    finally:
        _abandoning.clear()
