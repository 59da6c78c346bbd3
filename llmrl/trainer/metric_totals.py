"""The metrics of one policy update, from those of its micro-batches."""

from __future__ import annotations

import math


class MetricTotals:
    """Combines the loss metrics of micro-batches over the optimizer steps of one RL step.

    Losses add up over the micro-batches of an optimizer step (they share its denominator) and are
    averaged over steps; maxima stay maxima; everything else is weighted by its token count.
    """

    _SUMMED = ("loss", "pg_loss")
    _MAXED = ("is_weight_max",)
    _COUNTS = ("num_tokens", "num_sequences")

    def __init__(self) -> None:
        self._weighted: dict[str, float] = {}
        self._tokens = 0.0
        self._step_sums: dict[str, float] = {}
        self._sums: dict[str, float] = {}
        self._maxima: dict[str, float] = {}
        self._counts: dict[str, float] = {}
        self._grad_norms: list[float] = []
        self._skipped = 0

    def add_micro_batch(self, metrics: dict[str, float]) -> None:
        tokens = metrics["num_tokens"]
        self._tokens += tokens
        for key, value in metrics.items():
            if key in self._SUMMED:
                self._step_sums[key] = self._step_sums.get(key, 0.0) + value
            elif key in self._MAXED:
                self._maxima[key] = max(self._maxima.get(key, -math.inf), value)
            elif key in self._COUNTS:
                self._counts[key] = self._counts.get(key, 0.0) + value
            else:
                self._weighted[key] = self._weighted.get(key, 0.0) + value * tokens

    def add_optimizer_step(self, grad_norm: float) -> None:
        for key, value in self._step_sums.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
        self._step_sums = {}
        self._grad_norms.append(grad_norm)

    def add_skipped(self) -> None:
        self._skipped += 1

    @classmethod
    def combine(cls, parts: list[MetricTotals]) -> MetricTotals:
        """The totals of one step trained in shares (one per rank, same optimizer steps) as one."""
        combined = cls()
        for part in parts:
            combined._tokens += part._tokens
            for target, source in (
                (combined._weighted, part._weighted),
                (combined._sums, part._sums),
                (combined._counts, part._counts),
            ):
                for key, value in source.items():
                    target[key] = target.get(key, 0.0) + value
            for key, value in part._maxima.items():
                combined._maxima[key] = max(combined._maxima.get(key, -math.inf), value)
        combined._grad_norms = list(parts[0]._grad_norms)  # global norms: the same on every rank
        combined._skipped = parts[0]._skipped
        return combined

    def result(self) -> dict[str, float]:
        steps = len(self._grad_norms)
        out = {key: value / steps for key, value in self._sums.items()} if steps else {"loss": 0.0}
        out.update({key: value / self._tokens for key, value in self._weighted.items() if self._tokens})
        out.update(self._maxima)
        out.update(self._counts)
        out["grad_norm"] = sum(self._grad_norms) / steps if steps else 0.0
        out["optimizer_steps"] = float(steps)
        out["skipped_updates"] = float(self._skipped)
        return out
