"""Seeded problem order with epochs: every problem once per epoch, resumable from a saved cursor.

Epoch e visits the indices 0..size-1 in the order of a permutation drawn from a generator seeded by
(seed, e), so the whole order is a pure function of (seed, epoch, position): saving those three
numbers is enough to resume exactly where a run stopped, without replaying earlier draws.
"""

from __future__ import annotations

import random
from typing import Any


class EpochSampler:
    """Draws indices of `size` problems in a seeded shuffled order, epoch after epoch."""

    def __init__(self, size: int, seed: int = 0):
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.size = size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        # A string seed is hashed with SHA-512 by `random`, so the order does not depend on
        # PYTHONHASHSEED or on the platform.
        order = list(range(self.size))
        random.Random(f"epoch-sampler:{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        """The next `count` indices; an epoch boundary inside the draw starts the next permutation."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        indices = []
        for _ in range(count):
            if self.position == self.size:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            indices.append(self._order[self.position])
            self.position += 1
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; a different problem count or seed would silently change the order."""
        for key in ("size", "seed"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state.get(key)!r} but this sampler has {key}={getattr(self, key)!r}; "
                    "the problem set or seed changed since the state was saved"
                )
        if not 0 <= state["position"] <= self.size or state["epoch"] < 0:
            raise ValueError(
                f"sampler state has an invalid cursor: epoch={state['epoch']}, position={state['position']}"
            )
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._permutation(self.epoch)
