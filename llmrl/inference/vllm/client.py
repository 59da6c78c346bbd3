"""VLLMInterface: requests routed over vLLM servers, failed ones moved or their server restarted,
responses stamped with the weight version they were admitted under.

Generation goes through one `OpenAIInterface` per server, to the server with the fewest requests
outstanding; a request that fails on a dead server is retried on the others (or on the same one
once it has been restarted, which is announced in one log line). Each request is admitted by the
weight transport (`llmrl.inference.vllm.transports`), which holds new requests back while a sync
runs and says which version, and which adapter, the request is served by.

A request that continues from ``prompt_token_ids`` (multi-turn, agent programs) is rendered into ids
with the model's tokenizer, as the embedded engine renders it, and sent to vLLM as a token prompt:
vLLM never re-tokenises earlier turns (`OpenAIInterface`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from llmrl.config import ConfigError, InferenceConfig, ModelConfig, VLLMConfig
from llmrl.inference.interface import Health, InferenceInterface, Reachability, run_blocking, run_sync
from llmrl.inference.openai import (
    InferenceServerError,
    OpenAIInterface,
    UnsupportedServerError,
    api_key_from_env,
)
from llmrl.inference.vllm.adapters import AdapterTransport
from llmrl.inference.vllm.compatibility import check_trainable, vllm_pause_mode
from llmrl.inference.vllm.routed_experts import refuse_router_replay
from llmrl.inference.vllm.routes import ControlSettings, VLLMRoutes
from llmrl.inference.vllm.server import VLLMServer, find_vllm_python, start_servers, temporary_folder
from llmrl.inference.vllm.transports import BroadcastTransport, BucketTransport, Recover, VLLMTransport
from llmrl.models import load_tokenizer
from llmrl.types import InferenceRequest, InferenceResponse
from llmrl.weights import Manifest, PayloadKind, WeightTransport, transport_for

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Endpoint:
    """One server as the interface routes to it; only the interface writes it."""

    url: str
    client: OpenAIInterface
    routes: VLLMRoutes
    reachability: Reachability
    server: VLLMServer | None = None  # managed servers only
    manifest: Manifest = field(default_factory=dict)  # of the served checkpoint, read at start
    outstanding: int = 0
    served: int = 0  # requests answered
    restarts: int = 0
    restart_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, url: str, settings: ControlSettings, server: VLLMServer | None, **client: Any) -> Endpoint:
        """The server at `url`: a generation client (`client`: its options) and its control routes,
        which tell one reachability how each request went."""
        root, reachability = url.rstrip("/").removesuffix("/v1"), Reachability()
        routes = VLLMRoutes(root, settings, reachability)
        return cls(root, OpenAIInterface(url, **client), routes, reachability, server=server)

    def recover(
        self,
        index: int,
        transport: VLLMTransport[Any, Any],
        max_restarts: int,
        why: str,
        give: Callable[[], str] | None,
    ) -> bool:
        """Make this managed server (`index` of the `transport`'s), which failed, serve again: restart
        it when it no longer answers, then `give` it what it failed to take (a sync; a healthy server
        is given it again) or, after a restart without one, the last good weights
        (`VLLMTransport.restore`). Returns whether it serves (False for external servers and spent
        restarts)."""
        server = self.server
        if server is None:
            return False
        with self.restart_lock, transport.held(index):
            restart = not (server.alive() and run_blocking(self.routes.healthy()))
            if restart and self.restarts >= max_restarts:
                return False
            # A healthy server after a failed request: another request restarted it meanwhile, or
            # the failure passed. Nothing to give it unless a sync failed.
            if restart:
                state = server.exit_description()
                self.restarts += 1
                server.stop()
                server.start()
                transport.forget(index)
            given = give() if give is not None else transport.restore(index) if restart else ""
            if restart:
                log.warning(
                    "vLLM server %d at %s restarted (restart %d of %d): %s, %s; given %s",
                    index,
                    self.url,
                    self.restarts,
                    max_restarts,
                    why,
                    state,
                    given,
                )
            return True

    def check(self, config: VLLMConfig, lora_rank: int | None) -> None:
        """Whether the server can be trained from (`IncompatibleServerError` if not); read its manifest."""
        self.manifest = run_blocking(check_trainable(self.routes, config, lora_rank)).get("manifest") or {}


class VLLMInterface(InferenceInterface):
    """`InferenceInterface` over one or more vLLM servers (managed or external)."""

    def __init__(
        self,
        base_urls: list[str],
        *,
        config: VLLMConfig,
        servers: list[VLLMServer] | None = None,
        request_timeout_s: float = 120,
        max_concurrent: int = 64,
        weight_sync_timeout_s: float = 300,
        bucket_mb: int = 512,
        weights_dir: str | Path | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        lora_rank: int | None = None,
        tokenizer: Any | None = None,
        pause_mode: Literal["wait", "abort"] = "wait",
    ):
        """
        Args:
            base_urls: the servers' roots (``http://host:port``, with or without ``/v1``).
            config: the vLLM section (transport, timeouts, restarts).
            servers: the managed server of each URL (None: external servers, never restarted).
            request_timeout_s: limit of one generation request.
            max_concurrent: requests in flight per server.
            weight_sync_timeout_s: limit of the transfer of one bucket.
            bucket_mb: most megabytes of weights in one update request or file.
            weights_dir: folder the trainer and the servers both read (transport `disk`).
            api_key: bearer token of external servers.
            transport: the httpx transport of every client (tests pass a mock).
            lora_rank: the rank of the LoRA adapters each sync sends (None: whole weights); the
                servers must hold `config.max_loras` adapters of it.
            tokenizer: the model's tokenizer, which renders requests with ``prompt_token_ids`` into
                the token prompt vLLM is sent (None: such requests are refused).
            pause_mode: what a sync does with requests in flight: ``wait`` for them (each sample
                generated by one version) or ``abort`` them (finish_reason "abort").
        """
        if not base_urls:
            raise ConfigError("inference.base_url: give at least one server")
        if config.transport == "disk" and weights_dir is None:
            raise ConfigError("inference.weights_dir: required with inference.vllm.transport 'disk'")
        if lora_rank is not None and config.max_loras is None:
            raise ConfigError("inference.vllm.max_loras: required with LoRA adapters")
        self.config = config
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        settings = ControlSettings(
            config.control_timeout_s, weight_sync_timeout_s, pause_mode, api_key, transport
        )
        self._endpoints = [
            Endpoint.of(
                url,
                settings,
                servers[i] if servers else None,
                api_key=api_key,
                timeout_s=request_timeout_s,
                max_concurrent=max_concurrent,
                # A managed server's failed request is retried once it has been restarted: no retries
                # (and no warning each) before that.
                max_retries=0 if servers else 1,
                transport=transport,
                tokenizer=tokenizer,
            )
            for i, url in enumerate(base_urls)
        ]
        try:
            for endpoint in self._endpoints:
                endpoint.check(config, lora_rank)
        except BaseException:
            self.close()
            raise
        self.transport = vllm_transport(
            config,
            self._endpoints,
            self._recover,
            lora=lora_rank is not None,
            bucket_bytes=bucket_mb << 20,
            weights_dir=Path(weights_dir).resolve() if weights_dir is not None else None,
            transfer_timeout_s=weight_sync_timeout_s,
        )

    @classmethod
    def from_config(
        cls, config: InferenceConfig, model: ModelConfig, *, seed: int, run_dir: Path | None = None
    ) -> VLLMInterface:
        """External servers when `config.base_url` is set; otherwise managed servers of `model`,
        logging to ``run_dir/vllm/`` (a temporary folder without a run)."""
        vllm = config.vllm
        if config.record_routes:
            refuse_router_replay(None if config.base_url else find_vllm_python(vllm.python))
        lora_rank = model.lora.rank if model.lora is not None else None
        common = dict(
            config=vllm,
            request_timeout_s=config.request_timeout_s,
            max_concurrent=config.resolved_max_concurrent,
            weight_sync_timeout_s=config.weight_sync_timeout_s,
            bucket_mb=config.weight_sync_bucket_mb,
            api_key=api_key_from_env(config.api_key_env),
            lora_rank=lora_rank,
            tokenizer=load_tokenizer(model.spec, trust_remote_code=model.trust_remote_code),
            pause_mode=vllm_pause_mode(config),
        )
        if config.base_url:
            urls = config.base_url if isinstance(config.base_url, list) else [config.base_url]
            return cls(urls, weights_dir=config.weights_dir, **common)
        folder = Path(run_dir) / "vllm" if run_dir is not None else Path(temporary_folder())
        weights_dir = config.weights_dir or (str(folder / "weights") if vllm.transport == "disk" else None)
        servers = start_servers(model, vllm, folder, seed=seed, lora_rank=lora_rank)
        try:
            return cls([s.base_url for s in servers], servers=servers, weights_dir=weights_dir, **common)
        except BaseException:
            for server in servers:
                server.close()
            raise

    @property
    def policy_version(self) -> int:
        return self.transport.version or 0

    @property
    def base_urls(self) -> list[str]:
        return [e.url for e in self._endpoints]

    def health(self) -> Health:
        """The servers that stopped answering (restarts spent, or external) and since when the
        first of them did; every server while all answer."""
        lost = [e for e in self._endpoints if e.reachability.since is not None]
        if not lost:
            return Health(servers=tuple(e.client.base_url for e in self._endpoints))
        since = min(e.reachability.since for e in lost if e.reachability.since is not None)
        return Health(servers=tuple(e.client.base_url for e in lost), unreachable_since=since)

    # -- generation ------------------------------------------------------------------------------

    async def agenerate(self, request: InferenceRequest | dict[str, Any]) -> list[InferenceResponse]:
        """Sample on the least loaded server; a failed server's request is retried on another (or
        on the same one, restarted)."""
        if isinstance(request, dict):
            request = InferenceRequest.model_validate(request)
        if request.prompt_token_ids is not None and self.tokenizer is None:
            # vLLM would answer after a prompt without them, and the answer be refused only then.
            raise UnsupportedServerError(
                "prompt_token_ids: continuing a conversation on vLLM needs the model's tokenizer (tokenizer=)"
            )
        failed: set[str] = set()
        last_error: InferenceServerError | None = None
        while True:
            endpoint = self._least_loaded(failed)
            if endpoint is None:
                assert last_error is not None
                raise last_error
            index = self._endpoints.index(endpoint)
            admission = await self.transport.admit(index)
            with self._lock:
                endpoint.outstanding += 1
            try:
                responses = await endpoint.client.agenerate(request, model=admission.model)
                endpoint.served += 1
                endpoint.reachability.observe(200)
                return [r.model_copy(update={"policy_version": admission.version}) for r in responses]
            except InferenceServerError as exc:
                if exc.status is not None and exc.status < 500:
                    raise
                endpoint.reachability.observe(exc.status)
                last_error = exc
                failed.add(endpoint.url)
                if await asyncio.to_thread(self._recover, index, f"a request failed ({exc})"):
                    failed.discard(endpoint.url)
            finally:
                with self._lock:
                    endpoint.outstanding -= 1
                self.transport.release(index, admission)

    def generate(self, request: InferenceRequest | dict[str, Any]) -> list[InferenceResponse]:
        """Blocking form of `agenerate` (not from inside a running event loop)."""
        return run_sync(self._closing(self.agenerate(request)))

    def _least_loaded(self, failed: set[str]) -> Endpoint | None:
        with self._lock:
            candidates = [e for e in self._endpoints if e.url not in failed]
            return min(candidates, key=lambda e: e.outstanding, default=None)

    async def _closing(self, coroutine: Any) -> Any:
        try:
            return await coroutine
        finally:
            for endpoint in self._endpoints:
                await endpoint.client.aclose()

    # -- recovery --------------------------------------------------------------------------------

    def _recover(self, index: int, why: str, give: Callable[[], str] | None = None) -> bool:
        """Make server `index`, which failed, serve again (`Endpoint.recover`)."""
        return self._endpoints[index].recover(index, self.transport, self.config.max_restarts, why, give)

    # -- weights ---------------------------------------------------------------------------------

    def weight_transport(self, kind: PayloadKind) -> WeightTransport[Any]:
        """The transport `inference.vllm.transport` names (adapters: the servers load each version)."""
        return transport_for([self.transport], kind, "vLLM started for this run")

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the managed servers and delete the weight files this interface wrote."""
        if hasattr(self, "transport"):  # not when a server failed the start-up checks
            self.transport.close()
        for endpoint in self._endpoints:
            if endpoint.server is not None:
                endpoint.server.close()

    def __enter__(self) -> VLLMInterface:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def vllm_transport(
    config: VLLMConfig,
    endpoints: list[Endpoint],
    recover: Recover,
    *,
    lora: bool,
    bucket_bytes: int,
    weights_dir: Path | None,
    transfer_timeout_s: float,
) -> VLLMTransport[Any, Any]:
    """The one transport a run's config and payload kind (`lora`) name."""
    routes, manifests = [e.routes for e in endpoints], [e.manifest for e in endpoints]
    if lora:
        return AdapterTransport(routes, manifests, recover, folder=weights_dir)
    if config.transport == "nccl":
        return BroadcastTransport(routes, manifests, recover, timeout_s=transfer_timeout_s)
    folder = weights_dir if config.transport == "disk" else None
    return BucketTransport(routes, manifests, recover, bucket_bytes=bucket_bytes, folder=folder)
