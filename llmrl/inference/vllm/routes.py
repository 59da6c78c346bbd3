"""One vLLM server's control routes (`VLLMRoutes`), and the weight-sync sequence over them.

A weight sync on one server, for the bucket transports (the NCCL transport runs the same routes
around its broadcast, `llmrl.weights.nccl`)::

    POST /pause?mode=wait          in-flight requests finish on the old weights
    POST /start_weight_update
    POST /update_weights           once per bucket
    POST /finish_weight_update {"weight_version": "<version>"}
    POST /reset_prefix_cache       cached prompt blocks hold the old weights' keys
    POST /resume                   always, retried: a lost resume would leave it paused
    GET  /weight_info              must read back the version

A LoRA adapter sync needs no pause: each version is loaded under a name of its own, which the
requests admitted from then on carry as their ``model``, so a running request keeps the adapter it
started with; versions no request uses any more are unloaded at the next sync::

    POST /v1/load_lora_adapter {"lora_name": "<name of the version>", "lora_path": "<PEFT folder>"}
    POST /v1/unload_lora_adapter {"lora_name": "<an older version's name>"}

Every call has a timeout and a failure raises `WeightSyncError` (or the error a caller asks for)
naming the server and the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from llmrl.http_client import HTTPRequestError, RetryPolicy, send
from llmrl.inference.interface import Reachability
from llmrl.weights import Bucket, WeightSyncError


@dataclass(frozen=True)
class ControlSettings:
    """How control calls are made: their limits, the pause mode, authentication, the httpx transport."""

    control_timeout_s: float
    transfer_timeout_s: float
    pause_mode: str = "wait"
    api_key: str | None = None
    transport: httpx.AsyncBaseTransport | None = None


class VLLMRoutes:
    """The control routes of one server (`llmrl.weights.nccl.ServerRoutes` and the bucket sequence);
    every answer, or its absence, is reported to `reachability`."""

    def __init__(self, url: str, settings: ControlSettings, reachability: Reachability):
        self.url = url
        self.settings = settings
        self.reachability = reachability

    def client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        return httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=self.settings.control_timeout_s,
            transport=self.settings.transport,
        )

    async def call(
        self,
        method: str,
        path: str,
        *,
        timeout_s: float | None = None,
        error: type[Exception] = WeightSyncError,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """One control call under its timeout; a failure raises `error` (message, status=) naming the
        server and the call."""
        policy = RetryPolicy(timeout_s or self.settings.control_timeout_s)
        try:
            async with self.client() as client:
                answer = await send(
                    client, method, path, policy, on_answer=self.reachability.observe, **kwargs
                )
        except HTTPRequestError as exc:
            if exc.status is None:
                raise error(f"vLLM at {self.url}: {method} {path}: {exc.failure}", status=None) from None
            raise error(
                f"vLLM at {self.url}: {method} {path} answered {exc.status}: {exc.detail[:500]}",
                status=exc.status,
            ) from None
        try:
            data = answer.json()
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    async def healthy(self) -> bool:
        try:
            await self.call("GET", "/health")
        except WeightSyncError:
            return False
        return True

    # -- the sync sequence -----------------------------------------------------------------------

    async def sync(self, buckets: Iterable[Bucket], version: int) -> None:
        """Serve `buckets` as `version` on this server (the whole sequence of the module docstring)."""
        await self.call("POST", f"/pause?mode={self.settings.pause_mode}")
        try:
            await self.call("POST", "/start_weight_update")
            for bucket in buckets:
                await self.update(bucket.update_info())
        except BaseException:
            await self.resume()
            raise
        await self.end(version)

    async def begin(self) -> None:
        await self.call("POST", f"/pause?mode={self.settings.pause_mode}")
        await self.call("POST", "/start_weight_update")

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        await self.call(
            "POST",
            "/update_weights",
            json={"update_info": update_info},
            timeout_s=self.settings.transfer_timeout_s,
        )

    async def end(self, version: int) -> None:
        """Finish the update as `version`, resume (whatever happened) and confirm the version."""
        try:
            await self._finish(version)
        finally:
            await self.resume()
        served = (await self.call("GET", "/weight_info")).get("weight_version")
        if served != str(version):
            raise WeightSyncError(
                f"vLLM at {self.url} reports weight version {served!r} after syncing {version}"
            )

    async def _finish(self, version: int) -> None:
        await self.call(
            "POST",
            "/finish_weight_update",
            json={"weight_version": str(version)},
            timeout_s=self.settings.transfer_timeout_s,
        )
        for _ in range(20):  # fails while blocks are held; none are after a `wait`/`abort` pause
            answer = await self.call("POST", "/reset_prefix_cache")
            if answer.get("success", True):
                return
            await asyncio.sleep(0.05)
        raise WeightSyncError(f"vLLM at {self.url}: the prefix cache could not be reset after the update")

    async def resume(self) -> None:
        """Resuming twice is harmless and a lost resume leaves the server paused for good: retried."""
        for attempt in range(3):
            try:
                await self.call("POST", "/resume")
                return
            except WeightSyncError:
                if attempt == 2:
                    raise
                await asyncio.sleep(0.5 * 2**attempt)

    # -- LoRA adapters -------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        await self.call(
            "POST",
            "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": path},
            timeout_s=self.settings.transfer_timeout_s,
        )

    async def unload_adapter(self, name: str) -> None:
        await self.call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    # -- NCCL ------------------------------------------------------------------------------------

    async def world_size(self) -> int:
        return int((await self.call("GET", "/get_world_size"))["world_size"])

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await self.call(
            "POST",
            "/init_weight_transfer_engine",
            json={"init_info": init_info},
            timeout_s=self.settings.transfer_timeout_s,
        )
