"""How weights reach vLLM servers: the transports a run's config chooses from (`client.vllm_transport`).

| transport | takes | how |
|---|---|---|
| `BucketTransport` | whole weights | buckets of safetensors bytes in requests (``http``) or files both sides read (``disk``), through each server's route sequence (`VLLMRoutes.sync`) |
| `BroadcastTransport` | whole weights | vLLM's NCCL engine to the servers' GPU workers (``nccl``, `llmrl.weights.nccl`) |
| `AdapterTransport` | LoRA adapters | a PEFT folder each server loads under a name of its own (`llmrl.inference.vllm.adapters`) |

Each transport owns what each server serves (`ServingState`): the version requests are stamped with,
the gate that holds new requests back during a sync, and (adapters) the adapter requests are sent to.
The interface asks it at every request (`admit`, `release`). Everything sent is checked first,
against the tensor manifest of each served checkpoint. A server that fails a sync is handed to the
interface's `Recover` (which restarts it if it no longer answers) and given the same version again;
a restarted server is given the last good version through the same transport (`restore`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from llmrl.inference.interface import run_blocking, run_in_new_loop
from llmrl.inference.vllm.routes import VLLMRoutes
from llmrl.weights import (
    Bucket,
    FullWeights,
    Manifest,
    Payload,
    WeightSyncError,
    WeightTransport,
    check_names,
    check_version,
    check_weights,
    delete_bucket_files,
    serialised_buckets,
)
from llmrl.weights.nccl import NCCLTransport

PayloadT = TypeVar("PayloadT", bound=Payload)
Served = TypeVar("Served")
"""What a server is given to serve a version (weight buckets, an adapter to load)."""


class Recover(Protocol):
    """The interface's way to make a failed server serve again: restart it if it no longer answers,
    then call `give`, which says what it gave (or, after a restart without one, the transport's
    `restore`). Returns whether it serves (False for external servers and spent restarts)."""

    def __call__(self, index: int, why: str, give: Callable[[], str] | None = None) -> bool: ...


@dataclass
class ServingState:
    """What one server serves, as requests see it."""

    version: int = 0
    model: str | None = None
    """The adapter requests are sent to (None: the server's weights)."""
    running: Counter[str] = field(default_factory=Counter)
    """Requests in flight per adapter."""
    loaded: set[str] = field(default_factory=set)
    """Adapters loaded on the server."""
    open: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.open.set()


@dataclass(frozen=True)
class Admission:
    """What a request was admitted under: the version it is stamped with, the model it asks for."""

    version: int
    model: str | None


class VLLMTransport(WeightTransport[PayloadT], Generic[PayloadT, Served]):
    """Weight versions to every server of an interface; `version` is the one they serve (None before
    the first sync)."""

    def __init__(self, routes: list[VLLMRoutes], manifests: list[Manifest], recover: Recover):
        self.routes = routes
        self.manifests = manifests
        self.recover = recover
        self.states = [ServingState() for _ in routes]
        self.version: int | None = None
        self.lock = threading.Lock()
        self.last_good: tuple[int, Served] | None = None

    def send(self, payload: PayloadT, version: int, *, reset: bool = False) -> None:
        """Serve `payload` as `version` on every server; returns once all of them do. The served
        version again is a no-op, an older one refused, unless `reset` is set."""
        check_version(version)
        if not reset and version == self.version:
            return
        if not reset and self.version is not None and version < self.version:
            raise WeightSyncError(f"version {version} is older than the served version {self.version}")
        self.deliver(payload, version)
        self.version = version

    @abstractmethod
    def deliver(self, payload: PayloadT, version: int) -> None: ...

    async def serve(self, index: int, served: Served, version: int) -> None:
        """Make server `index` serve `served` as `version` (transports that keep a last good version)."""
        raise NotImplementedError

    # -- requests --------------------------------------------------------------------------------

    async def admit(self, index: int) -> Admission:
        """Admit a request to server `index`, once no sync holds it back."""
        state = self.states[index]
        if not state.open.is_set():
            await asyncio.to_thread(state.open.wait)
        with self.lock:
            if state.model is not None:
                state.running[state.model] += 1
            return Admission(state.version, state.model)

    def release(self, index: int, admission: Admission) -> None:
        if admission.model is not None:
            with self.lock:
                self.states[index].running[admission.model] -= 1

    @contextlib.contextmanager
    def held(self, index: int) -> Iterator[None]:
        """New requests to server `index` wait while inside (they get the version served after)."""
        self.states[index].open.clear()
        try:
            yield
        finally:
            self.states[index].open.set()

    # -- failures --------------------------------------------------------------------------------

    async def serve_all(self, served: Served, version: int) -> None:
        """`serve` on every server at once; one that fails is recovered and given it again, or the
        sync fails."""
        results = await asyncio.gather(
            *(self.serve(i, served, version) for i in range(len(self.routes))), return_exceptions=True
        )
        for index, error in enumerate(results):
            if not isinstance(error, BaseException):
                continue

            def give(index: int = index) -> str:
                run_in_new_loop(self.serve(index, served, version))
                return f"weights version {version}"

            why = f"a weight sync failed ({error})"
            if not await asyncio.to_thread(self.recover, index, why, give):
                if isinstance(error, WeightSyncError):
                    raise error
                raise WeightSyncError(f"weight sync to vLLM at {self.routes[index].url} failed: {error}")

    def forget(self, index: int) -> None:
        """Server `index` was restarted: it serves nothing it was given."""
        self.states[index] = ServingState(open=self.states[index].open)

    def restore(self, index: int) -> str:
        """Give server `index` the last good version; says what it was given."""
        if self.last_good is None:
            return "its own weights (none synced yet)"
        version, served = self.last_good
        run_in_new_loop(self.serve(index, served, version))
        return f"weights version {version}"

    def close(self) -> None:
        """Delete the files this transport wrote."""


class BucketTransport(VLLMTransport[FullWeights, list[Bucket]]):
    """Whole weights in buckets through each server's route sequence: safetensors bytes in the requests
    (``http``), or files in `folder`, which the servers read too (``disk``).

    Each incoming bucket is checked and serialised (split again by `bucket_bytes`) before the next is
    read, and the serialised buckets are kept until the next sync succeeds: they are the last good
    weights a restarted server gets. So this transport holds one serialised copy of the weights,
    plus one incoming bucket."""

    takes = ("weights",)

    def __init__(self, *args: Any, bucket_bytes: int, folder: Path | None):
        super().__init__(*args)
        self.bucket_bytes = bucket_bytes
        self.folder = folder

    def deliver(self, payload: FullWeights, version: int) -> None:
        buckets: list[Bucket] = []
        try:
            for part in checked_buckets(payload, self.manifests, self.routes):
                buckets += serialised_buckets(
                    part,
                    self.bucket_bytes,
                    folder=self.folder,
                    prefix=f"llmrl-v{version}-",
                    first_index=len(buckets),
                )
        except BaseException:
            delete_bucket_files(buckets)
            raise
        run_blocking(self.serve_all(buckets, version))
        previous, self.last_good = self.last_good, (version, buckets)
        if previous is not None:
            delete_bucket_files(previous[1])

    async def serve(self, index: int, served: list[Bucket], version: int) -> None:
        with self.held(index):
            await self.routes[index].sync(served, version)
            self.states[index].version = version

    def close(self) -> None:
        if self.last_good is not None:
            delete_bucket_files(self.last_good[1])


class BroadcastTransport(VLLMTransport[FullWeights, None]):
    """Whole weights broadcast by NCCL to every server's GPU workers at once (the transfer group is
    joined at the first sync). A restarted server cannot rejoin the group: it serves its own weights
    until the servers are restarted together."""

    takes = ("weights",)

    def __init__(self, *args: Any, timeout_s: float):
        super().__init__(*args)
        self.timeout_s = timeout_s
        self._nccl: NCCLTransport | None = None

    def deliver(self, payload: FullWeights, version: int) -> None:
        state = {
            name: t
            for part in checked_buckets(payload, self.manifests, self.routes)
            for name, t in part.items()
        }
        if self._nccl is None:
            self._nccl = NCCLTransport(self.routes, timeout_s=self.timeout_s)
        with contextlib.ExitStack() as held:
            for index in range(len(self.routes)):
                held.enter_context(self.held(index))
            self._nccl.send(FullWeights.of(state), version)
            for serving in self.states:
                serving.version = version


def checked_buckets(
    payload: FullWeights, manifests: list[Manifest], routes: list[VLLMRoutes]
) -> Iterator[dict[str, Any]]:
    """The payload's buckets, each checked against every served checkpoint's manifest as it is read,
    and the names of all of them once the last is in."""
    served = [(manifest, r.url) for manifest, r in zip(manifests, routes, strict=True) if manifest]
    names: set[str] = set()
    for part in payload.buckets():
        for manifest, url in served:
            check_weights(part, manifest, url, complete=False)
        names |= part.keys()
        yield part
    for manifest, url in served:
        check_names(names, manifest, url)
