"""The `nccl` transport of `VLLMInterface`: weights broadcast from the trainer to the servers' GPU
workers with vLLM's own NCCL trainer engine, around the same route sequence as the other transports.

The trainer is NCCL rank 0; the workers of server i join at 1 + the world sizes (tensor x pipeline
x data parallel) of the servers before it. vLLM drives the broadcast; llmrl gives it a control
client that speaks to every server at once and adds what vLLM leaves to the caller: the pause
before, the prefix-cache reset and resume after, the version check, and a timeout on the
broadcast (a collective cannot be cancelled, so it runs on a worker thread and the caller stops
waiting; the servers must then be restarted).

This needs a CUDA GPU and vllm importable in the trainer's environment, so it is not exercised on
CPU-only CI; the `http` transport runs the same route sequence there.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import httpx
import torch

from llmrl.http_client import free_port
from llmrl.inference.interface import run_in_new_loop
from llmrl.inference.openai import WeightSyncError

if TYPE_CHECKING:
    from llmrl.inference.vllm import VLLMInterface, _Endpoint


class ServersControl:
    """vLLM's `VLLMWeightSyncClient` protocol, fanned out to every server over HTTP."""

    def __init__(self, interface: VLLMInterface, endpoints: list[_Endpoint], rank_offsets: list[int]):
        self.interface = interface
        self.endpoints = endpoints
        self.rank_offsets = rank_offsets
        self.version = 0

    def _on_all(self, calls: Any) -> None:
        async def run() -> None:
            async def one(endpoint: _Endpoint, offset: int) -> None:
                async with self.interface._control_client(endpoint) as client:
                    await calls(client, endpoint, offset)

            await asyncio.gather(*(one(e, o) for e, o in zip(self.endpoints, self.rank_offsets, strict=True)))

        run_in_new_loop(run())

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        async def call(client: httpx.AsyncClient, endpoint: _Endpoint, offset: int) -> None:
            await self.interface._control(client, endpoint, "POST", "/init_weight_transfer_engine",
                                          json={"init_info": init_info | {"rank_offset": offset}},
                                          timeout_s=self.interface.weight_sync_timeout_s)  # fmt: skip

        self._on_all(call)

    def start_weight_update(self) -> None:
        async def call(client: httpx.AsyncClient, endpoint: _Endpoint, offset: int) -> None:
            await self.interface._control(client, endpoint, "POST", f"/pause?mode={self.interface.config.pause_mode}")
            await self.interface._control(client, endpoint, "POST", "/start_weight_update")

        self._on_all(call)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        async def call(client: httpx.AsyncClient, endpoint: _Endpoint, offset: int) -> None:
            await self.interface._control(client, endpoint, "POST", "/update_weights",
                                          json={"update_info": update_info},
                                          timeout_s=self.interface.weight_sync_timeout_s)  # fmt: skip

        self._on_all(call)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        async def call(client: httpx.AsyncClient, endpoint: _Endpoint, offset: int) -> None:
            try:
                await self.interface._finish(client, endpoint, self.version)
            finally:
                await self.interface._resume(client, endpoint)
            await self.interface._confirm_version(client, endpoint, self.version)
            endpoint.version = self.version

        self._on_all(call)

    def resume_all(self) -> None:
        async def call(client: httpx.AsyncClient, endpoint: _Endpoint, offset: int) -> None:
            await self.interface._resume(client, endpoint)

        self._on_all(call)


class StateSource:
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


class NCCLSync:
    """Joins the servers' workers in one NCCL group at construction; `send` broadcasts a state dict."""

    def __init__(self, interface: VLLMInterface, endpoints: list[_Endpoint]):
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
        self.interface = interface
        world_sizes = [self._world_size(e) for e in endpoints]
        offsets = [1 + sum(world_sizes[:i]) for i in range(len(endpoints))]
        self.control = ServersControl(interface, endpoints, offsets)
        self.source = StateSource()
        address = _master_address([e.url for e in endpoints])
        info = NCCLTrainerInitInfo(master_address=address, master_port=free_port(address),
                                   world_size=1 + sum(world_sizes), rank=0)  # fmt: skip
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=self.control, source=self.source.as_weight_source()
        )
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nccl-weights")

    def _world_size(self, endpoint: _Endpoint) -> int:
        response = httpx.get(f"{endpoint.url}/get_world_size", timeout=self.interface.config.control_timeout_s)
        if response.status_code != 200:
            raise WeightSyncError(f"vLLM at {endpoint.url}: GET /get_world_size answered {response.status_code}")
        return int(response.json()["world_size"])

    def send(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.source.state = state
        self.control.version = version
        future = self._sender.submit(self.engine.send_weights)
        try:
            future.result(timeout=self.interface.weight_sync_timeout_s)
        except FutureTimeout:
            self.control.resume_all()
            raise WeightSyncError(
                f"the NCCL weight broadcast did not finish within inference.weight_sync_timeout_s="
                f"{self.interface.weight_sync_timeout_s:g} s; the transfer group is unusable, restart the servers"
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
