"""The transport to llmrl's inference server: ``POST /v1/weights`` with a file path or the file itself.

The server takes one file per update, whole weights or a LoRA adapter (its config in the file's
metadata, `AdapterWeights.file_tensors`; the server merges it onto its base weights), so this
transport takes both payload kinds. A payload read from a path inside `weights_dir` (the folder
both sides read: a file or a folder of shards) is sent as that path, and one read from a
``.safetensors`` file elsewhere is streamed from it. Any other payload becomes one file: with a
`weights_dir` it is written there as ``llmrl-policy-v{version}.safetensors`` and sent as a path
relative to it (the previous such file is deleted once the server has loaded the next); without one,
it is streamed in the request body.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from llmrl.files import atomic_write
from llmrl.weights.buckets import safetensors_ready
from llmrl.weights.payloads import Payload
from llmrl.weights.transport import WeightSyncError, WeightTransport, check_version

_CHUNK_BYTES = 1 << 20

Post = Callable[..., Awaitable[Any]]
"""``post(path, **request)``: the server's decoded JSON answer to one POST, or `WeightSyncError`."""


class LlmrlServerTransport(WeightTransport[Payload]):
    """Weights or adapters to one llmrl inference server; `version` is what it serves after the last send."""

    takes = ("weights", "adapters")

    def __init__(
        self, post: Post, run: Callable[[Coroutine[Any, Any, None]], None], weights_dir: Path | None
    ):
        """`post` sends one request to the server's API root; `run` runs a coroutine to its end
        from synchronous code (the client's event-loop bridge)."""
        self._post = post
        self._run = run
        self.weights_dir = weights_dir
        self.version = 0
        self._written_file: Path | None = None  # the last weights file written into weights_dir

    def send(self, payload: Payload, version: int, *, reset: bool = False) -> None:
        self._run(self.asend(payload, version, reset=reset))

    async def asend(self, payload: Payload, version: int, *, reset: bool = False) -> None:
        """The server refuses a version older than the one it serves, and takes the one it serves
        as a no-op, unless `reset` is set."""
        check_version(version)
        target: dict[str, Any] = {"version": version, **({"reset": True} if reset else {})}
        path = payload.path.resolve() if payload.path is not None else None
        if path is not None and self._in_weights_dir(path):
            await self._send_path(path, target)
        elif path is not None and path.is_file() and path.suffix == ".safetensors":
            await self._stream_file(path, target)
        else:
            await self._send_file(*payload.file_tensors(), target)

    async def _send_file(
        self, state: dict[str, Any], metadata: dict[str, str], target: dict[str, Any]
    ) -> None:
        version = target["version"]
        metadata = {**metadata, "policy_version": str(version)}
        if self.weights_dir is not None:
            path = self.weights_dir / f"llmrl-policy-v{version}.safetensors"
            await asyncio.to_thread(_write_safetensors, state, path, metadata)
            await self._send_path(path, target)
            previous, self._written_file = self._written_file, path
            if previous is not None and previous != path:
                previous.unlink(missing_ok=True)  # the server has loaded the new one; keep the folder small
            return
        from safetensors.torch import save_file

        handle, name = tempfile.mkstemp(prefix="llmrl-weights-", suffix=".safetensors")
        os.close(handle)
        try:
            await asyncio.to_thread(save_file, safetensors_ready(state), name, metadata)
            await self._stream_file(Path(name), target)
        finally:
            Path(name).unlink(missing_ok=True)

    async def _send_path(self, path: Path, target: dict[str, Any]) -> None:
        assert self.weights_dir is not None
        # Relative: the server resolves it in its own weights_dir, wherever the shared disk is mounted there.
        relative = path.relative_to(self.weights_dir).as_posix()
        await self._sync(json={**target, "path": relative})

    async def _stream_file(self, path: Path, target: dict[str, Any]) -> None:
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(path.stat().st_size)}
        await self._sync(params=target, headers=headers, content=_file_chunks(path))

    async def _sync(self, **request: Any) -> None:
        answer = await self._post("/weights", **request)
        version = answer.get("policy_version") if isinstance(answer, dict) else None
        if not isinstance(version, int):
            raise WeightSyncError(f"weight sync: the server's answer has no policy_version: {answer!r}")
        self.version = version

    def _in_weights_dir(self, path: Path) -> bool:
        return self.weights_dir is not None and self.weights_dir in path.parents


def _write_safetensors(state: dict[str, Any], path: Path, metadata: dict[str, str]) -> None:
    """Write `state` to `path` whole or not at all (the server may read the folder at any time)."""
    from safetensors.torch import save

    atomic_write(path, save(safetensors_ready(state), metadata=metadata))


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as file:
        while chunk := await asyncio.to_thread(file.read, _CHUNK_BYTES):
            yield chunk
