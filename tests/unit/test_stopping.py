"""A stop on a signal: the exit statuses, and where a step may be abandoned (`llmrl.stopping`)."""

from __future__ import annotations

import asyncio
import pickle
import signal
import threading

import pytest

from llmrl.stopping import StepAbandoned, StoppedBySignal, abandonable, stop_abandons_steps
from llmrl.trainer.trainer import _stop_on_signals


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]
)
def test_a_stop_exits_as_a_shell_reports_the_signal(signum, status):
    stop = StoppedBySignal(signum)
    assert isinstance(stop, KeyboardInterrupt)  # what Ctrl-C's stop always was: `except Exception` lets it by
    assert stop.exit_status == status and stop.name == signal.Signals(signum).name


def test_an_abandoned_step_travels_to_the_other_ranks_with_its_signal():
    received = pickle.loads(pickle.dumps(StepAbandoned(signal.SIGTERM)))  # as broadcast_object sends it
    assert isinstance(received, StepAbandoned) and received.signum == signal.SIGTERM


def test_a_stop_abandons_the_step_waiting_and_the_next_wait_after_it():
    with stop_abandons_steps() as abandon:
        with pytest.raises(StepAbandoned) as during, abandonable():
            abandon(signal.SIGTERM)  # the signal handler, while the step waits
        assert during.value.signum == signal.SIGTERM
        with pytest.raises(StepAbandoned), abandonable():  # a stop that came between waits
            pytest.fail("entered a wait after the stop")
    with abandonable():  # the run that stopped ended: another one in this process starts afresh
        pass


def test_a_stop_outside_a_wait_lets_the_step_finish():
    with stop_abandons_steps() as abandon:
        abandon(signal.SIGHUP)  # no raise: the step trains, and the stop after it comes first


def test_only_the_main_thread_waits_abandonably():
    """Signals are handled on the main thread: a wait on another thread (a batch drawn ahead) is never
    abandoned, and the stop does not leak into it."""
    outcome: list[str] = []

    def wait_elsewhere() -> None:
        with abandonable():
            outcome.append("waited")

    with stop_abandons_steps() as abandon:
        abandon(signal.SIGTERM)
        thread = threading.Thread(target=wait_elsewhere)
        thread.start()
        thread.join()
    assert outcome == ["waited"]


def test_a_stop_during_an_event_loop_cancels_its_tasks_and_abandons_once_they_ended():
    """With no generation lag a batch is drawn in an event loop on the trainer's thread: its tasks end
    by cancellation, each leaving its context managers in order, rather than by an exception raised at
    whatever line they were."""
    ended: list[str] = []

    async def request() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ended.append("request")
            raise

    async def draw(abandon) -> None:
        waiting = asyncio.ensure_future(request())
        await asyncio.sleep(0)
        abandon(signal.SIGTERM)  # as the signal handler does, on the loop's thread
        await waiting

    with stop_abandons_steps() as abandon, pytest.raises(StepAbandoned) as stop, abandonable():
        asyncio.run(draw(abandon))
    assert ended == ["request"] and stop.value.signum == signal.SIGTERM


class Lines:
    def __init__(self):
        self.lines: list[str] = []

    def message(self, line: str) -> None:
        self.lines.append(line)


@pytest.mark.parametrize(
    ("save_now", "line"),
    [
        (False, "SIGTERM: stopping after this step and saving a checkpoint (SIGTERM again stops at once)"),
        (
            True,
            "SIGTERM: stopping (a step that has begun its update finishes first) and saving a checkpoint "
            "(SIGTERM again stops at once)",
        ),
    ],
)
def test_a_signal_outside_a_wait_is_acknowledged_in_one_line_that_holds_for_either_setting(save_now, line):
    """Between steps with save_now, the next step is abandoned with a line of its own: the first line
    must not promise to finish it."""
    display = Lines()
    with _stop_on_signals(display, save_now=save_now) as received:
        signal.raise_signal(signal.SIGTERM)
        assert received() == signal.SIGTERM
        if save_now:
            with pytest.raises(StepAbandoned), abandonable():
                pass
    assert display.lines == [line]
