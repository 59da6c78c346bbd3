"""LoRA deltas merged into served weights: each version serves base + delta, the base kept aside.

A decoder serving a LoRA-trained policy runs merged weights (no extra matmuls per token). Merging
the new delta onto the base copy, not onto the previous version, keeps rounding from piling up over
syncs in a low-precision dtype; the copy costs the adapted weights once more (the memory plan's
``engine`` term counts it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class MergedWeights:
    """The base values of served tensors that deltas were merged into, by state-dict name."""

    def __init__(self) -> None:
        self._bases: dict[str, torch.Tensor] = {}

    def merge(self, name: str, served: torch.Tensor, delta: torch.Tensor) -> None:
        """Make `served` (the tensor the forward reads, or a view of its rows) base + `delta` (float32,
        in `served`'s layout); its base is what it held before its first merge."""
        base = self._bases.get(name)
        if base is None:
            base = self._bases[name] = served.clone()
        served.copy_(base.float() + delta)

    def replaced(self, names: Iterable[str]) -> None:
        """Whole new weights were loaded for `names`: they are the base from now on."""
        for name in names:
            self._bases.pop(name, None)
