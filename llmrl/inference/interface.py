"""The one thing agents and the trainer share: an interface that turns requests into completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from llmrl.errors import ServerUnavailableError
from llmrl.types import InferenceRequest, InferenceResponse
from llmrl.weights import PayloadKind, WeightTransport, payload_from

if TYPE_CHECKING:
    from typing import Self

    from llmrl.config import InferenceConfig, ModelConfig

T = TypeVar("T")


class InferenceUnavailableError(ServerUnavailableError):
    """The inference server was lost: nothing it produced since is kept, and rerunning the same
    command resumes (the CLI exits with 75). The message is one line."""


class RequestRejected(ValueError):
    """The request cannot be served as it is (a prompt too long for the model's context, token ids
    outside the vocabulary): retrying cannot pass, so an agent drops its problem from the batch
    (a ``data:`` failure) rather than the run stopping for a rerun that would fail the same way."""


@dataclass(frozen=True)
class Health:
    """What an inference interface knows of where it generates and whether that answers."""

    servers: tuple[str, ...] = ()
    """The servers requests go to, or those of them that do not answer when any does not (none:
    the engine runs in this process)."""
    unreachable_since: float | None = None
    """When (`time.time()`) requests began failing to reach a server; None while they reach all."""
    shared_url: str | None = None
    """The API root another process may send requests to in this interface's stead (an
    environment server generating for a remote agent); None when requests must go through it."""
    model: str | None = None
    """The model name requests to `shared_url` carry (None: the server's first)."""


class Reachability:
    """Since when a server has been unreachable, told of every request's outcome (`observe`)."""

    def __init__(self) -> None:
        self.since: float | None = None

    def observe(self, status: int | None) -> None:
        """`status`: the HTTP status of an answer, None for no answer; 5xx counts as none."""
        if status is not None and status < 500:  # it answered: reachable, even when it refuses
            self.since = None
        elif self.since is None:
            self.since = time.time()


@runtime_checkable
class InferenceInterface(Protocol):
    """Generates completions and serves new weights; implementations batch concurrent `agenerate` calls.

    The trainer builds one with `from_config`, generates with it, syncs every step's weights through
    the transport `weight_transport` gives it, asks `health` why a request or a sync failed (a lost
    server stops the run with `InferenceUnavailableError`: rerunning resumes) and calls `close` on
    every exit. Plug-in interfaces (`llmrl.registry.register_inference`) implement the same, and get
    `update_weights` by subclassing this class.
    """

    @classmethod
    def from_config(
        cls, config: InferenceConfig, model: ModelConfig, *, seed: int, run_dir: Path | None
    ) -> Self:
        """The interface `config` describes, serving `model` (`seed`: of requests that carry none;
        `run_dir`: the run folder for logs and files, None outside a run)."""
        ...

    async def agenerate(self, request: InferenceRequest) -> list[InferenceResponse]:
        """Sample `request.n` completions of one prompt."""
        ...

    def generate(self, request: InferenceRequest) -> list[InferenceResponse]:
        """Blocking form of `agenerate`."""
        ...

    def weight_transport(self, kind: PayloadKind) -> WeightTransport[Any]:
        """The transport that serves payloads of `kind` ("weights" or "adapters") here, built from
        this interface's config (`llmrl.weights.WrongPayloadError` when it serves the other kind)."""
        ...

    def update_weights(self, weights: Any, version: int, *, reset: bool = False) -> None:
        """Serve new weights, stamping later responses with `version`.

        Versions normally only grow; `reset` replaces whatever is served even with an older version
        (a trainer starting or resuming a run owns the sequence). `weights`: a payload
        (`llmrl.weights.FullWeights`, `AdapterWeights`), a state dict, a file or folder of weights or
        of a PEFT adapter, or an iterable of bucket dicts (`llmrl.weights.payload_from`)."""
        payload = payload_from(weights)
        self.weight_transport(payload.kind).send(payload, version, reset=reset)

    def health(self) -> Health:
        """Where requests go and whether they reach it (cheap: no request is sent)."""
        ...

    def close(self) -> None:
        """Release what the interface holds (servers it started, files it wrote, threads)."""
        ...


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from synchronous code (no event loop may be running)."""
    if running_loop() is not None:
        raise RuntimeError("generate() was called inside a running event loop; await agenerate() instead")
    return run_in_new_loop(coroutine)


def run_blocking(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from synchronous code, from anywhere: inside a running event
    loop it runs on a fresh loop in a worker thread, blocking the caller (checkpointing, start-up
    checks, weight updates)."""
    if running_loop() is None:
        return run_in_new_loop(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run_in_new_loop, coroutine).result()


def run_in_new_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coroutine)``, without ever formatting its result as text.

    On Python 3.11 and 3.12, ``asyncio.run`` on the main thread ends by looking up the SIGINT
    handler it installed, and that lookup builds the repr of the main task, result included: for
    a step's responses or rollouts, every token id and logprob as text, which costs more than the
    work it reports on. Here the main task returns nothing; the result travels beside it.
    """
    results: list[T] = []

    async def main() -> None:
        results.append(await coroutine)

    asyncio.run(main())
    return results[0]
