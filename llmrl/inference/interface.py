"""The one thing agents and the trainer share: an interface that turns requests into completions."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from llmrl.types import InferenceRequest, InferenceResponse


@runtime_checkable
class InferenceInterface(Protocol):
    """Generates completions; implementations batch concurrent `agenerate` calls."""

    async def agenerate(self, request: InferenceRequest) -> list[InferenceResponse]:
        """Sample `request.n` completions of one prompt."""
        ...

    def generate(self, request: InferenceRequest) -> list[InferenceResponse]:
        """Blocking form of `agenerate`."""
        ...

    def update_weights(
        self, state_dict_or_path: dict[str, Any] | str | Path, version: int, *, reset: bool = False
    ) -> None:
        """Serve new weights, stamping later responses with `version`.

        Versions normally only grow; `reset` replaces whatever is served even with an older version
        (a trainer starting or resuming a run owns the sequence)."""
        ...


def run_sync(coroutine: Any) -> Any:
    """Run a coroutine to completion from synchronous code (no event loop may be running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    raise RuntimeError("generate() was called inside a running event loop; await agenerate() instead")
