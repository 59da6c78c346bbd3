"""VLLMInterface: requests routed over vLLM servers, failed ones moved or their server restarted,
responses stamped with the weight version they were admitted under, weights synced to all at once.

Generation goes through one `OpenAIInterface` per server, to the server with the fewest requests
outstanding; a request that fails on a dead server is retried on the others (or on the same one
once it has been restarted, which is announced in one log line). New requests are held back from
the moment a sync starts until it ends, and the ``wait`` pause drains the rest, so each response
carries the version in force when it was admitted.

A request that continues from ``prompt_token_ids`` (multi-turn, agent programs) is rendered into ids
with the model's tokenizer, as the embedded engine renders it, and sent to vLLM as a token prompt:
vLLM never re-tokenises earlier turns (`OpenAIInterface`).

Everything sent is checked first, against the tensor manifest of the served checkpoint: every name
present (fused q/k/v and gate/up pieces travel together), same shapes, floating point and finite.

With LoRA (`lora_rank`), a sync sends no weights: each adapter version is written once in PEFT's
format (to `weights_dir`, or a temporary folder of this interface) and loaded on every server under
a name of its own, which the requests admitted from then on carry as their ``model``. Requests are
not held back: a running request keeps the adapter version it was admitted under (and is stamped
with it), and a version is unloaded, its folder deleted, once no request uses it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from llmrl.config import ConfigError, InferenceConfig, ModelConfig, VLLMConfig
from llmrl.inference.interface import Health, run_blocking, run_in_new_loop, run_sync
from llmrl.inference.openai import (
    InferenceServerError,
    OpenAIInterface,
    UnsupportedServerError,
    api_key_from_env,
)
from llmrl.inference.vllm.compatibility import check_trainable
from llmrl.inference.vllm.routes import ControlSettings, Endpoint, VLLMRoutes
from llmrl.inference.vllm.server import VLLMServer, served_model_path, server_devices, temporary_folder
from llmrl.models import load_tokenizer
from llmrl.processes import free_port
from llmrl.types import InferenceRequest, InferenceResponse
from llmrl.weights import (
    AdapterWeights,
    Bucket,
    Weights,
    WeightSyncError,
    check_names,
    check_version,
    check_weights,
    delete_bucket_files,
    manifest_tensors,
    read_adapter,
    serialised_buckets,
    weight_parts,
)
from llmrl.weights.nccl import NCCLTransport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterVersion:
    """One adapter version as the servers load it: its name (new for each version, so requests running
    on an older one keep it) and its PEFT folder."""

    name: str
    folder: Path


Served = list[Bucket] | AdapterVersion
"""What a server is given to serve a version: weight buckets, or an adapter to load."""


class VLLMInterface:
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
        """
        if not base_urls:
            raise ConfigError("inference.base_url: give at least one server")
        if config.transport == "disk" and weights_dir is None:
            raise ConfigError("inference.weights_dir: required with inference.vllm.transport 'disk'")
        if lora_rank is not None and config.max_loras is None:
            raise ConfigError("inference.vllm.max_loras: required with LoRA adapters")
        self.config = config
        self.lora_rank = lora_rank
        self.tokenizer = tokenizer
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.bucket_bytes = bucket_mb << 20
        self.weights_dir = Path(weights_dir).resolve() if weights_dir is not None else None
        self._adapters_root = self.weights_dir  # made a temporary folder at the first adapter sync if None
        self._lock = threading.Lock()
        self._version: int | None = None  # None until the first sync
        self._last_good: tuple[int, Served] | None = None  # what a restarted server is given
        self._adapter_folders: dict[str, Path] = {}  # by adapter name, until no server holds it
        self._nccl: NCCLTransport | None = None
        # A managed server's failed request is retried once it has been restarted: no retries
        # (and no warning each) before that.
        retries = 0 if servers else 1
        self._endpoints = [
            Endpoint(
                url=url.rstrip("/").removesuffix("/v1"),
                client=OpenAIInterface(
                    url,
                    api_key=api_key,
                    timeout_s=request_timeout_s,
                    max_concurrent=max_concurrent,
                    max_retries=retries,
                    transport=transport,
                    tokenizer=tokenizer,
                ),
                server=servers[i] if servers else None,
            )
            for i, url in enumerate(base_urls)
        ]
        settings = ControlSettings(
            config.control_timeout_s, weight_sync_timeout_s, config.pause_mode, api_key, transport
        )
        self._routes = [VLLMRoutes(endpoint, settings) for endpoint in self._endpoints]
        try:
            for routes in self._routes:
                facts = run_blocking(check_trainable(routes, config, lora_rank))
                routes.endpoint.manifest = facts.get("manifest") or {}
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(
        cls, config: InferenceConfig, model: ModelConfig, *, seed: int, run_dir: Path | None = None
    ) -> VLLMInterface:
        """External servers when `config.base_url` is set; otherwise managed servers of `model`,
        logging to ``run_dir/vllm/`` (a temporary folder without a run)."""
        vllm = config.vllm
        lora_rank = model.lora.rank if model.lora is not None else None
        common = dict(
            config=vllm,
            request_timeout_s=config.request_timeout_s,
            max_concurrent=config.max_concurrent,
            weight_sync_timeout_s=config.weight_sync_timeout_s,
            bucket_mb=config.weight_sync_bucket_mb,
            api_key=api_key_from_env(config),
            lora_rank=lora_rank,
            tokenizer=load_tokenizer(model.spec, trust_remote_code=model.trust_remote_code),
        )
        if config.base_url:
            urls = config.base_url if isinstance(config.base_url, list) else [config.base_url]
            return cls(urls, weights_dir=config.weights_dir, **common)
        folder = Path(run_dir) / "vllm" if run_dir is not None else Path(temporary_folder())
        served = served_model_path(model, folder / "model")
        weights_dir = config.weights_dir or (str(folder / "weights") if vllm.transport == "disk" else None)
        servers = []
        try:
            for index in range(vllm.num_servers):
                port = vllm.port + index if vllm.port else free_port(vllm.host)
                devices = server_devices(index, vllm.tensor_parallel_size)
                server = VLLMServer(
                    model=served,
                    dtype=model.dtype,
                    config=vllm,
                    port=port,
                    seed=seed,
                    log_path=folder / f"server-{index}.log",
                    devices=devices,
                    lora_rank=lora_rank,
                )
                servers.append(server)
                server.spawn()
            for server in servers:  # they start side by side
                server.wait_ready()
            return cls([s.base_url for s in servers], servers=servers, weights_dir=weights_dir, **common)
        except BaseException:
            for server in servers:
                server.close()
            raise

    @property
    def policy_version(self) -> int:
        return self._version or 0

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
            if not endpoint.open.is_set():
                await asyncio.to_thread(endpoint.open.wait)
            with self._lock:
                endpoint.outstanding += 1
                version, adapter = endpoint.version, endpoint.adapter
                if adapter is not None:
                    endpoint.adapter_requests[adapter] += 1
            try:
                responses = await endpoint.client.agenerate(request, model=adapter)
                endpoint.served += 1
                endpoint.reachability.observe(200)
                return [r.model_copy(update={"policy_version": version}) for r in responses]
            except InferenceServerError as exc:
                if exc.status is not None and exc.status < 500:
                    raise
                endpoint.reachability.observe(exc.status)
                last_error = exc
                failed.add(endpoint.url)
                if await asyncio.to_thread(self._recover, endpoint, f"a request failed ({exc})"):
                    failed.discard(endpoint.url)
            finally:
                with self._lock:
                    endpoint.outstanding -= 1
                    if adapter is not None:
                        endpoint.adapter_requests[adapter] -= 1

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

    def _recover(self, endpoint: Endpoint, why: str, weights: tuple[int, Served] | None = None) -> bool:
        """Make a managed server that failed serve again: restart it when it no longer answers, then
        give it `weights` (a sync it failed; a healthy server is given them again) or, after a
        restart without them, the last good weights. Returns whether it serves (False for external
        servers and spent restarts)."""
        server = endpoint.server
        if server is None:
            return False
        routes = self._routes[self._endpoints.index(endpoint)]
        with endpoint.restart_lock:
            restart = not (server.alive() and run_blocking(routes.healthy()))
            if restart and endpoint.restarts >= self.config.max_restarts:
                return False
            # A healthy server after a failed request: another request restarted it meanwhile, or
            # the failure passed. Nothing to give it unless a sync failed.
            target = weights if weights is not None else (self._last_good if restart else None)
            endpoint.open.clear()
            try:
                if restart:
                    state = server.exit_description()
                    endpoint.restarts += 1
                    server.stop()
                    server.start()
                    endpoint.loaded_adapters.clear()
                if target is not None:
                    version, served = target
                    run_in_new_loop(self._serve(routes, served, version))
                if restart:
                    given = (
                        f"weights version {target[0]}"
                        if target is not None
                        else "its own weights (none synced yet)"
                    )
                    log.warning(
                        "vLLM server %d at %s restarted (restart %d of %d): %s, %s; given %s",
                        self._endpoints.index(endpoint),
                        endpoint.url,
                        endpoint.restarts,
                        self.config.max_restarts,
                        why,
                        state,
                        given,
                    )
            finally:
                endpoint.open.set()
            return True

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(self, state_dict_or_path: Weights, version: int, *, reset: bool = False) -> None:
        """Serve these weights as `version` on every server; returns once all of them do.

        Versions only grow unless `reset` is set (a trainer starting or resuming a run owns the
        sequence); the served version again is a no-op.

        Every tensor is checked before anything is sent. Over http or disk, each incoming dict is
        checked and serialised (split again by `bucket_mb`) before the next is read, and the
        serialised buckets are kept until the next sync succeeds: they are the last good weights a
        restarted server gets. So this interface holds one serialised copy of the weights, plus one
        incoming bucket; it frees the dicts it is given once serialised. The NCCL transport
        broadcasts one state dict: incoming buckets are collected into it first.
        """
        check_version(version)
        if not reset and version == self._version:
            return
        if not reset and self._version is not None and version < self._version:
            raise WeightSyncError(f"version {version} is older than the served version {self._version}")
        weights = (
            read_adapter(state_dict_or_path)
            if isinstance(state_dict_or_path, (str, Path))
            else state_dict_or_path
        )
        if isinstance(weights, AdapterWeights) != (self.lora_rank is not None):
            raise WeightSyncError(
                "LoRA adapters go to servers started for them (model.lora) and whole weights to others: "
                f"this interface serves {'adapters' if self.lora_rank is not None else 'whole weights'}"
            )
        if isinstance(weights, AdapterWeights):
            self._sync_adapter(weights, version)
            self._version = version
            return
        manifests = [(endpoint.manifest, endpoint.url) for endpoint in self._endpoints if endpoint.manifest]
        names: set[str] = set()
        state: dict[str, torch.Tensor] = {}  # NCCL only
        buckets: list[Bucket] = []  # http and disk
        folder = self.weights_dir if self.config.transport == "disk" else None
        try:
            for part in weight_parts(state_dict_or_path):
                for manifest, url in manifests:
                    check_weights(part, manifest, url, complete=False)
                names |= part.keys()
                if self.config.transport == "nccl":
                    state |= part
                else:
                    buckets += serialised_buckets(
                        part,
                        self.bucket_bytes,
                        folder=folder,
                        prefix=f"llmrl-v{version}-",
                        first_index=len(buckets),
                    )
            for manifest, url in manifests:
                check_names(names, manifest, url)
        except BaseException:
            delete_bucket_files(buckets)
            raise
        if self.config.transport == "nccl":
            self._send_nccl(state, version)
        else:
            run_blocking(self._sync_all(buckets, version))
            previous, self._last_good = self._last_good, (version, buckets)
            if previous is not None:
                assert isinstance(previous[1], list)  # an interface serves whole weights or adapters only
                delete_bucket_files(previous[1])
        self._version = version

    def _sync_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Write the adapter once, load it on every server and switch their requests to it; unload (and
        delete) the versions no request uses any more."""
        for endpoint in self._endpoints:
            if not endpoint.manifest:  # transport nccl: vLLM's backend reports none
                continue
            try:
                adapter.check(manifest_tensors(endpoint.manifest))
            except ValueError as exc:
                raise ValueError(f"{exc} (the model served at {endpoint.url})") from None
        name = f"llmrl-v{version}-{secrets.token_hex(4)}"
        loaded = AdapterVersion(name, adapter.save(self._adapters_dir() / name))
        self._adapter_folders[name] = loaded.folder
        run_blocking(self._sync_all(loaded, version))
        self._last_good = (version, loaded)
        for old, folder in list(self._adapter_folders.items()):
            if old != name and not any(old in e.loaded_adapters for e in self._endpoints):
                shutil.rmtree(folder, ignore_errors=True)
                del self._adapter_folders[old]

    def _adapters_dir(self) -> Path:
        if self._adapters_root is None:
            self._adapters_root = Path(temporary_folder())
        return self._adapters_root

    async def _serve(self, routes: VLLMRoutes, served: Served, version: int) -> None:
        """Make one server serve `version`: its weights (the whole sync sequence) or its adapter."""
        if isinstance(served, AdapterVersion):
            await self._load_adapter(routes, served, version)
        else:
            await routes.sync(served, version)

    async def _load_adapter(self, routes: VLLMRoutes, adapter: AdapterVersion, version: int) -> None:
        """Load `adapter`, send the requests admitted from now on to it, then unload the older versions
        that no request uses (a request counts itself in under the same lock it reads the adapter)."""
        await routes.load_adapter(adapter.name, str(adapter.folder))
        endpoint = routes.endpoint
        with self._lock:
            endpoint.loaded_adapters.add(adapter.name)
            endpoint.adapter, endpoint.version = adapter.name, version
            idle = [
                name
                for name in endpoint.loaded_adapters
                if name != adapter.name and not endpoint.adapter_requests[name]
            ]
        for name in idle:
            await routes.unload_adapter(name)
            endpoint.loaded_adapters.discard(name)
            endpoint.adapter_requests.pop(name, None)

    async def _sync_all(self, served: Served, version: int) -> None:
        if isinstance(served, AdapterVersion):
            syncs = [self._load_adapter(routes, served, version) for routes in self._routes]
        else:
            syncs = [self._gated(routes, served, version) for routes in self._routes]
        results = await asyncio.gather(*syncs, return_exceptions=True)
        failures = [
            (r, e) for r, e in zip(self._routes, results, strict=True) if isinstance(e, BaseException)
        ]
        for routes, error in failures:
            why = f"a weight sync failed ({error})"
            if not await asyncio.to_thread(self._recover, routes.endpoint, why, (version, served)):
                raise (
                    error
                    if isinstance(error, WeightSyncError)
                    else WeightSyncError(f"weight sync to vLLM at {routes.url} failed: {error}")
                )

    async def _gated(self, routes: VLLMRoutes, buckets: list[Bucket], version: int) -> None:
        routes.endpoint.open.clear()  # requests from now on wait, and get the new version
        try:
            await routes.sync(buckets, version)
        finally:
            routes.endpoint.open.set()

    def _send_nccl(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Broadcast `state` to every server's GPU workers with vLLM's own NCCL trainer engine."""
        if self._nccl is None:
            self._nccl = NCCLTransport(self._routes, timeout_s=self.weight_sync_timeout_s)
        for endpoint in self._endpoints:
            endpoint.open.clear()
        try:
            self._nccl.send(state, version)
        finally:
            for endpoint in self._endpoints:
                endpoint.open.set()

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the managed servers and delete the weight files this interface wrote."""
        if self._last_good is not None and isinstance(self._last_good[1], list):
            delete_bucket_files(self._last_good[1])
        for folder in self._adapter_folders.values():
            shutil.rmtree(folder, ignore_errors=True)
        for endpoint in self._endpoints:
            if endpoint.server is not None:
                endpoint.server.close()

    def __enter__(self) -> VLLMInterface:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
