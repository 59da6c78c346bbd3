"""LoRA adapters to vLLM servers, and their lifetime there.

A sync sends no weights: each adapter version is written once in PEFT's format (to `folder`, or a
temporary folder of the transport) and loaded on every server under a name of its own, which the
requests admitted from then on carry as their ``model``. Requests are not held back: a running
request keeps the adapter version it was admitted under (and is stamped with it), and a version is
unloaded once no request on that server uses it, its folder deleted once no server holds it.
"""

from __future__ import annotations

import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrl.inference.interface import run_blocking
from llmrl.inference.vllm.server import temporary_folder
from llmrl.inference.vllm.transports import VLLMTransport
from llmrl.weights import AdapterWeights, manifest_tensors


@dataclass(frozen=True)
class AdapterVersion:
    """One adapter version as the servers load it: its name (new for each version, so requests running
    on an older one keep it) and its PEFT folder."""

    name: str
    folder: Path


class AdapterTransport(VLLMTransport[AdapterWeights, AdapterVersion]):
    """LoRA adapters loaded on every server, each version under a new name."""

    takes = ("adapters",)

    def __init__(self, *args: Any, folder: Path | None):
        super().__init__(*args)
        self._root = folder  # made a temporary folder at the first sync if None
        self._folders: dict[str, Path] = {}  # by adapter name, until no server holds it

    def deliver(self, payload: AdapterWeights, version: int) -> None:
        """Write the adapter once, load it on every server and switch their requests to it; delete the
        folders of the versions no server holds any more."""
        for manifest, routes in zip(self.manifests, self.routes, strict=True):
            if not manifest:  # transport nccl: vLLM's backend reports none
                continue
            try:
                payload.check(manifest_tensors(manifest))
            except ValueError as exc:
                raise ValueError(f"{exc} (the model served at {routes.url})") from None
        name = f"llmrl-v{version}-{secrets.token_hex(4)}"
        loaded = AdapterVersion(name, payload.save(self._adapters_root() / name))
        self._folders[name] = loaded.folder
        run_blocking(self.serve_all(loaded, version))
        self.last_good = (version, loaded)
        for old, folder in list(self._folders.items()):
            if old != name and not any(old in state.loaded for state in self.states):
                shutil.rmtree(folder, ignore_errors=True)
                del self._folders[old]

    async def serve(self, index: int, served: AdapterVersion, version: int) -> None:
        """Load `served`, send the requests admitted from now on to it, then unload the older versions
        that no request uses (a request counts itself in under the same lock it reads the adapter)."""
        routes, state = self.routes[index], self.states[index]
        await routes.load_adapter(served.name, str(served.folder))
        with self.lock:
            state.loaded.add(served.name)
            state.model, state.version = served.name, version
            idle = [name for name in state.loaded if name != served.name and not state.running[name]]
        for name in idle:
            await routes.unload_adapter(name)
            state.loaded.discard(name)
            state.running.pop(name, None)

    def _adapters_root(self) -> Path:
        if self._root is None:
            self._root = Path(temporary_folder())
        return self._root

    def close(self) -> None:
        for folder in self._folders.values():
            shutil.rmtree(folder, ignore_errors=True)
