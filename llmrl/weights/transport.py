"""The one small interface every way of moving weights implements, and what it takes.

A transport delivers one version of the policy's weights to where they serve: the embedded engine
in this process (`in_process`), llmrl's inference server over HTTP or a shared folder
(`llmrl_server`), vLLM servers as buckets in requests or files (`llmrl.inference.vllm` runs the
route sequence around `Bucket`s) or by NCCL broadcast (`nccl`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from llmrl.weights.adapters import AdapterWeights

Weights = dict[str, Any] | str | Path | Iterable[dict[str, Any]] | AdapterWeights
"""What a weight update takes: a state dict, a file or folder of weights, a stream of buckets, or LoRA
adapters (`AdapterWeights`, also as a PEFT folder or one-file adapter), which serve added to the base
weights the receiver loaded (never the previous version's).

A stream of bucket dicts comes from a trainer gathering sharded weights bucket by bucket
(`weight_buckets`): together they hold every tensor once, a decoder layer's tensors in one bucket.
Each bucket may be produced on demand (collectives with other processes), so it is read in order,
at most once, and its tensors are not kept beyond what the receiver needs; the new version serves
once the last bucket is in. A receiver reads it to its end unless it fails or has nothing to do
(the version it already serves); a producer that needs it read to the end drains it."""


class WeightSyncError(RuntimeError):
    """A weight update failed or timed out; `status` is the server's HTTP status when it answered."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


class WeightTransport(Protocol):
    """Moves whole weight versions to one serving side; returns once `version` serves there."""

    def send(self, weights: Weights, version: int, *, reset: bool = False) -> None:
        """Deliver `weights` as `version` (`reset`: even when older than the version served)."""
        ...


def weight_parts(weights: Weights) -> Iterable[dict[str, Any]]:
    """`weights` as an iterable of dicts: one for a state dict or a path, the buckets of a stream."""
    from llmrl.weights.buckets import read_state_dict

    if isinstance(weights, AdapterWeights):
        raise TypeError("LoRA adapters are not weight parts: a receiver merges them (AdapterWeights.deltas)")
    if isinstance(weights, dict):
        return [weights]
    if isinstance(weights, (str, Path)):
        return [read_state_dict(weights)]
    return weights


def check_version(version: Any, maximum: int | None = None) -> None:
    """Refuse (ValueError) anything but an integer version >= 0 (and <= `maximum` when given)."""
    wanted = ">= 0" if maximum is None else f"in 0..{maximum}"
    too_large = maximum is not None and isinstance(version, int) and version > maximum
    if isinstance(version, bool) or not isinstance(version, int) or version < 0 or too_large:
        raise ValueError(f"version must be an integer {wanted}, got {version!r}")
