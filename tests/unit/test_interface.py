"""Running coroutines from synchronous code (`run_sync`, `run_blocking`, `run_in_new_loop`)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from llmrl.inference.interface import run_blocking, run_in_new_loop, run_sync


class ReprCounter:
    """A result that counts how often it is formatted as text."""

    def __init__(self):
        self.reprs = 0

    def __repr__(self) -> str:
        self.reprs += 1
        return "ReprCounter()"


async def returning(value):
    await asyncio.sleep(0)
    return value


def test_result_comes_back_without_being_formatted():
    # asyncio.run on the main thread (Python 3.11, 3.12) formats its main task's result when it
    # restores the SIGINT handler; a batch of rollouts would be rendered token by token.
    assert threading.current_thread() is threading.main_thread()
    results = [ReprCounter(), ReprCounter()]
    assert run_sync(returning(results)) is results
    assert run_in_new_loop(returning(results)) is results
    assert run_blocking(returning(results)) is results
    assert [r.reprs for r in results] == [0, 0]


def test_exceptions_of_the_coroutine_propagate():
    async def failing():
        raise ValueError("bad request")

    with pytest.raises(ValueError, match="bad request"):
        run_sync(failing())


def test_run_sync_refuses_a_running_loop():
    async def nested():
        coroutine = returning(1)
        try:
            run_sync(coroutine)
        finally:
            coroutine.close()

    with pytest.raises(RuntimeError, match="await agenerate"):
        asyncio.run(nested())


def test_run_blocking_inside_a_running_loop_uses_a_loop_of_its_own():
    async def caller():
        outer = asyncio.get_running_loop()

        async def inner():
            return (
                asyncio.get_running_loop() is not outer,
                threading.current_thread() is not threading.main_thread(),
            )

        return run_blocking(inner())

    assert asyncio.run(caller()) == (True, True)
