"""Colocated vLLM under torchrun: an engine in every process, all of them serving rank 0's agents.

Rank 0 alone runs the agents (`llmrl.trainer.distributed`), so its interface, `ColocatedRanks`, hands
each request to the engine with the fewest samples outstanding, its own or another process's. Every
other process runs a `RankService`, which submits the requests rank 0 sends it to its own engine and
sends back the responses. Requests and responses are pickled over one socket per process pair
(`multiprocessing.connection`, with a key rank 0 draws and shares through the process group), read by
a thread of their own: they never wait behind the trainer's collectives, and a process that ends
closes its socket, which the other side reads as the end (a gloo receive still pending when its
group is destroyed aborts the process instead).

A weight sync is each process's own: the FSDP2 buckets every process gathers anyway go to its own
engine, in memory. Engines give a seeded request the same tokens whichever serves it, so rank 0
seeds every request that comes without a seed before it picks an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch.distributed as dist

from llmrl.inference.interface import Health, InferenceInterface, run_sync
from llmrl.inference.vllm.colocated import ColocatedVLLM, with_seed, world_size
from llmrl.types import InferenceRequest, InferenceResponse
from llmrl.weights import PayloadKind, WeightTransport

_CLOSE = "close"  # rank 0 to a service: nothing more will come


def across_processes(local: ColocatedVLLM, *, seed: int) -> InferenceInterface:
    """This process's interface: in one process, `local` itself; under torchrun, every process's
    engine joined to rank 0 (a collective: every process calls it once, after its engine started):
    rank 0 gets the interface its agents generate with, the others the service that serves it. Each
    side's `weight_transport` is its own engine's."""
    if world_size() == 1:
        return local
    rank, processes = dist.get_rank(), dist.get_world_size()
    same_host = int(os.environ.get("LOCAL_WORLD_SIZE", processes)) == processes
    listener = None
    meeting: list[Any] = [None, None]
    if rank == 0:
        key = secrets.token_bytes(32)
        host = "127.0.0.1" if same_host else "0.0.0.0"  # noqa: S104 (other hosts' ranks connect; the key guards it)
        listener = Listener((host, 0), authkey=key)
        advertised = "127.0.0.1" if same_host else os.environ.get("MASTER_ADDR", "127.0.0.1")
        meeting = [(advertised, listener.address[1]), key]
    dist.broadcast_object_list(meeting, src=0)
    address, key = meeting
    if listener is not None:
        connections: dict[int, Connection] = {}
        with listener:
            while len(connections) < processes - 1:
                connection = listener.accept()
                connections[connection.recv()] = connection
        return ColocatedRanks(local, [connections[peer] for peer in range(1, processes)], seed=seed)
    connection = Client(address, authkey=key)
    connection.send(rank)
    return RankService(local, connection, rank=rank)


class _Peer:
    """One end of a socket to another process: pickled messages out (under a lock: several threads
    send), and a thread that hands every message it reads to `on_message` until the socket ends, then
    calls `on_end`."""

    def __init__(
        self,
        connection: Connection,
        name: str,
        on_message: Callable[[Any], None],
        on_end: Callable[[], None] = lambda: None,
    ):
        self.connection = connection
        self.closing = False
        self._sending = threading.Lock()
        self._on_message = on_message
        self._on_end = on_end
        self.ended = threading.Event()
        self.error: BaseException | None = None
        """Why the socket ended without a close from this side (None: it was closed here)."""
        self._reader = threading.Thread(target=self._read, name=name, daemon=True)
        self._reader.start()

    def send(self, message: Any) -> bool:
        """Send `message`; False when the socket has ended."""
        try:
            with self._sending:
                self.connection.send(message)
            return True
        except (OSError, ValueError):  # closed on either side
            return False

    def _read(self) -> None:
        try:
            while True:
                message = self.connection.recv()
                if message == _CLOSE:
                    return
                self._on_message(message)
        except Exception as exc:  # noqa: BLE001 (EOF, or the socket closed under the read by `close`)
            if not self.closing:
                self.error = exc
        finally:
            self.ended.set()
            self._on_end()

    def close(self) -> None:
        self.closing = True
        # Closing the descriptor alone neither wakes this side's reader (blocked in recv) nor, while that
        # read holds the socket open, ends it for the other process: a shutdown does both.
        with contextlib.suppress(OSError):  # closed already
            with socket.socket(fileno=os.dup(self.connection.fileno())) as end:
                end.shutdown(socket.SHUT_RDWR)
        self.connection.close()


class _RemoteEngine:
    """Rank 0's handle on another process's engine: requests out, responses back by its reader."""

    def __init__(self, connection: Connection, rank: int):
        self.rank = rank
        self._pending: dict[int, Future[list[InferenceResponse]]] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        self.peer = _Peer(connection, f"colocated-vllm-{rank}", self._answered, self._fail_pending)

    def submit(self, request: InferenceRequest) -> Future[list[InferenceResponse]]:
        future: Future[list[InferenceResponse]] = Future()
        with self._lock:
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._pending[request_id] = future
        # A socket that ended before the request was registered fails it here; after, `_fail_pending`.
        if not self.peer.send((request_id, request)) or self.peer.ended.is_set():
            self._fail(request_id, self._lost())
        return future

    def _answered(self, message: tuple[int, list[InferenceResponse] | BaseException]) -> None:
        request_id, result = message
        with self._lock:
            future = self._pending.pop(request_id, None)
        if future is None:  # failed already: the socket ended while the answer was on its way
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def _fail(self, request_id: int, error: BaseException) -> None:
        with self._lock:
            future = self._pending.pop(request_id, None)
        if future is not None:
            future.set_exception(error)

    def _fail_pending(self) -> None:
        with self._lock:
            ids = list(self._pending)
        for request_id in ids:
            self._fail(request_id, self._lost())

    def _lost(self) -> RuntimeError:
        why = f": {self.peer.error}" if self.peer.error else ""
        return RuntimeError(f"lost the colocated vLLM engine of process {self.rank} (its process ended{why})")


class ColocatedRanks(InferenceInterface):
    """Rank 0's interface over every process's colocated engine: each request goes to the engine
    with the fewest samples outstanding (rank 0's own first on a tie)."""

    def __init__(self, local: ColocatedVLLM, connections: list[Connection], *, seed: int | None = None):
        """
        Args:
            local: this process's engine.
            connections: to the other processes' services, in rank order (process 1 first).
            seed: seeds the generator that gives each request without a seed its own (as `ColocatedVLLM`'s).
        """
        self.local = local
        self.remotes = [_RemoteEngine(connection, rank) for rank, connection in enumerate(connections, 1)]
        self._submitters: list[Callable[[InferenceRequest], Future[list[InferenceResponse]]]] = [
            local.submit,
            *(remote.submit for remote in self.remotes),
        ]
        self._outstanding = [0] * len(self._submitters)
        self.requests_served = [0] * len(self._submitters)
        """Requests each process's engine was given, in rank order."""
        self._lock = threading.Lock()
        self._seeds = random.Random(seed)
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self.local.policy_version

    async def agenerate(self, request: InferenceRequest | dict[str, Any]) -> list[InferenceResponse]:
        """Sample `request.n` completions on the least busy engine; `ValueError` for a request that
        does not fit (`ColocatedVLLM.submit`)."""
        return await asyncio.wrap_future(self.submit(request))

    def generate(self, request: InferenceRequest | dict[str, Any]) -> list[InferenceResponse]:
        """Blocking form of `agenerate`."""
        return run_sync(self.agenerate(request))

    def submit(self, request: InferenceRequest | dict[str, Any]) -> Future[list[InferenceResponse]]:
        """Seed `request` if it has no seed, and queue it on the engine with the fewest samples
        outstanding; the future holds its responses."""
        if isinstance(request, dict):
            request = InferenceRequest.model_validate(request)
        with self._lock:
            request = with_seed(request, self._seeds)
            rank = min(range(len(self._submitters)), key=self._outstanding.__getitem__)
            self._outstanding[rank] += request.n
            self.requests_served[rank] += 1
        try:
            future = self._submitters[rank](request)
        except BaseException:
            self._done(rank, request.n)
            raise
        future.add_done_callback(lambda _: self._done(rank, request.n))
        return future

    def _done(self, rank: int, samples: int) -> None:
        with self._lock:
            self._outstanding[rank] -= samples

    def weight_transport(self, kind: PayloadKind) -> WeightTransport[Any]:
        """This process's engine's transport: every process syncs its own engine."""
        return self.local.weight_transport(kind)

    def health(self) -> Health:
        return Health(servers=tuple(f"vLLM in process {rank}" for rank in range(len(self._submitters))))

    def close(self) -> None:
        """Tell the other processes' services that nothing more will come, then shut this engine down."""
        if self._closed:
            return
        self._closed = True
        for remote in self.remotes:
            remote.peer.send(_CLOSE)
            remote.peer.close()
        self.local.close()


class RankService(InferenceInterface):
    """Another process's colocated engine serving rank 0: what rank 0 sends, it submits to the engine,
    and it sends back each response (or the error the request failed with)."""

    def __init__(self, local: ColocatedVLLM, connection: Connection, *, rank: int):
        self.local = local
        self.rank = rank
        self.peer = _Peer(connection, "colocated-vllm-service", self._serve)

    @property
    def policy_version(self) -> int:
        return self.local.policy_version

    def _serve(self, message: tuple[int, InferenceRequest]) -> None:
        request_id, request = message
        try:
            future = self.local.submit(request)
        except Exception as exc:  # noqa: BLE001 (the request's caller, on rank 0, gets it)
            self.peer.send((request_id, _portable(exc, self.rank)))
            return
        future.add_done_callback(lambda done: self._answer(request_id, done))

    def _answer(self, request_id: int, done: Future[list[InferenceResponse]]) -> None:
        error = done.exception()
        self.peer.send((request_id, done.result() if error is None else _portable(error, self.rank)))

    async def agenerate(self, request: InferenceRequest | dict[str, Any]) -> list[InferenceResponse]:
        """This process's engine alone (rank 0's agents reach it through `ColocatedRanks`)."""
        return await self.local.agenerate(request)

    def generate(self, request: InferenceRequest | dict[str, Any]) -> list[InferenceResponse]:
        return self.local.generate(request)

    def weight_transport(self, kind: PayloadKind) -> WeightTransport[Any]:
        return self.local.weight_transport(kind)

    def health(self) -> Health:
        return Health(servers=(f"vLLM in process {self.rank}, serving process 0",))

    def close(self) -> None:
        """Stop serving and shut the engine down. A clean run's processes all reach the end after rank
        0's last request (the trainer waits for each other there), so nothing is cut short."""
        self.peer.close()
        self.local.close()


def _portable(error: BaseException, rank: int) -> BaseException:
    """`error` as rank 0 can unpickle it: a refused request stays a `ValueError`; anything else
    becomes a `RuntimeError` naming the process and the error's type."""
    if isinstance(error, ValueError):
        return ValueError(str(error))
    return RuntimeError(f"colocated vLLM of process {rank}: {type(error).__name__}: {error}")


__all__ = ["ColocatedRanks", "RankService", "across_processes"]
