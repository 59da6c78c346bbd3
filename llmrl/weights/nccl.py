"""The NCCL transport: weights broadcast from the trainer to vLLM servers' GPU workers with vLLM's
own NCCL trainer engine, around the same route sequence as the bucket transports.

The trainer is NCCL rank 0; the workers of server i join at 1 + the world sizes (tensor x pipeline
x data parallel) of the servers before it. vLLM drives the broadcast; llmrl gives it a control
client that runs each server's routes (`ServerRoutes`, `llmrl.inference.vllm.routes.VLLMRoutes`)
on every server at once:
the pause before, the prefix-cache reset and resume after, the version check, and a timeout on the
broadcast (a collective cannot be cancelled, so it runs on a worker thread and the caller stops
waiting; the servers must then be restarted).

This needs a CUDA GPU and vllm importable in the trainer's environment, so it is not exercised on
CPU-only CI; the `http` transport runs the same route sequence there.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol
from urllib.parse import urlparse

import torch

from llmrl.processes import free_port
from llmrl.weights.payloads import FullWeights
from llmrl.weights.transport import WeightSyncError, WeightTransport


class ServerRoutes(Protocol):
    """One vLLM server's weight-update routes (`llmrl.inference.vllm.routes.VLLMRoutes`)."""

    url: str

    async def world_size(self) -> int: ...
    async def init_transfer(self, init_info: dict[str, Any]) -> None: ...
    async def begin(self) -> None: ...
    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...
    async def end(self, version: int) -> None: ...
    async def resume(self) -> None: ...


class _ServersClient:
    """vLLM's `VLLMWeightSyncClient` protocol, fanned out to every server."""

    def __init__(self, servers: Sequence[ServerRoutes], rank_offsets: list[int]):
        self.servers = servers
        self.rank_offsets = rank_offsets
        self.version = 0  # of the broadcast under way

    def _on_all(self, call: Callable[[ServerRoutes, int], Awaitable[None]]) -> None:
        async def run() -> None:
            await asyncio.gather(*(call(s, o) for s, o in zip(self.servers, self.rank_offsets, strict=True)))

        asyncio.run(run())

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._on_all(lambda server, offset: server.init_transfer(init_info | {"rank_offset": offset}))

    def start_weight_update(self) -> None:
        self._on_all(lambda server, offset: server.begin())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._on_all(lambda server, offset: server.update(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """vLLM's NCCL engine names no `weight_version`: the broadcast's own is served then."""
        version = int(weight_version) if weight_version is not None else self.version
        self._on_all(lambda server, offset: server.end(version))

    def resume_all(self) -> None:
        self._on_all(lambda server, offset: server.resume())


class _StateSource:
    """The state dict of the current sync as vLLM's `WeightSource` (built lazily: it needs vllm)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def as_weight_source(self) -> Any:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        holder = self

        class Source(WeightSource):
            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in holder.state.items()]

            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                for name, tensor in holder.state.items():
                    yield name, tensor.detach().to("cuda").contiguous()

        return Source()


class NCCLTransport(WeightTransport[FullWeights]):
    """Whole weights to vLLM servers' workers, joined in one NCCL group at construction."""

    takes = ("weights",)

    def __init__(self, servers: Sequence[ServerRoutes], *, timeout_s: float):
        try:
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        except ImportError as exc:
            raise WeightSyncError(
                f"inference.vllm.transport 'nccl' needs vllm in the trainer's environment too ({exc}); "
                "install the server's vllm version there, or use transport 'http' or 'disk'"
            ) from None
        if not torch.cuda.is_available():
            raise WeightSyncError("inference.vllm.transport 'nccl' needs a CUDA GPU on the trainer")
        self.timeout_s = timeout_s

        async def world_sizes() -> list[int]:
            return list(await asyncio.gather(*(s.world_size() for s in servers)))

        sizes = asyncio.run(world_sizes())
        offsets = [1 + sum(sizes[:i]) for i in range(len(servers))]
        self.client = _ServersClient(servers, offsets)
        self.source = _StateSource()
        address = _master_address([s.url for s in servers])
        info = NCCLTrainerInitInfo(
            master_address=address, master_port=free_port(address), world_size=1 + sum(sizes), rank=0
        )
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=self.client, source=self.source.as_weight_source()
        )
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nccl-weights")

    def send(self, payload: FullWeights, version: int, *, reset: bool = False) -> None:
        """Broadcast one state dict (buckets are collected into it); the caller checks versions."""
        self.source.state = payload.state_dict()
        self.client.version = version
        future = self._sender.submit(self.engine.send_weights)
        try:
            future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self.client.resume_all()
            raise WeightSyncError(
                f"the NCCL weight broadcast did not finish within inference.weight_sync_timeout_s="
                f"{self.timeout_s:g} s; the transfer group is unusable, restart the servers"
            ) from None


def _master_address(urls: list[str]) -> str:
    """Loopback when every server is on this machine, else this machine's address."""
    hosts = {urlparse(url).hostname or "" for url in urls}
    if all(host == "localhost" or _is_loopback(host) for host in hosts):
        return "127.0.0.1"
    return socket.gethostbyname(socket.getfqdn())


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
