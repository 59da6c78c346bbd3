"""The in-process transport: new weights for a model in this process (the embedded engine).

The engine applies an update between decode steps; `InProcessTransport.send` turns what it is given
(a state dict, a safetensors/torch file, a folder of them, or an iterable of bucket dicts) into a
`WeightUpdate`, each bucket checked against the names, shapes and floating-ness of the model's
``state_dict`` as recorded when the transport was built (`served_tensors`): the Llama/Qwen2 decoder
may since have released some of the model's tensors into its fused ones. LoRA adapters (given as
`AdapterWeights`, a PEFT folder or a one-file adapter) become an update of deltas (`merge`): the
receiver serves each of its base weights plus the delta.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmrl.weights.adapters import AdapterWeights, read_adapter
from llmrl.weights.buckets import read_state_dict
from llmrl.weights.checks import ServedTensor, check_state_dict, served_tensors
from llmrl.weights.transport import Weights


@dataclass(eq=False)
class WeightUpdate:
    buckets: Iterable[dict[str, torch.Tensor]]  # read once, when the update is applied
    version: int
    merge: bool = False
    """The buckets hold LoRA deltas to add to the base weights, not weights."""
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class InProcessTransport:
    """`WeightTransport` into a model of this process: `send` checks what it can at once and hands
    the update to `apply`, which returns once the model holds it (raising the update's error)."""

    def __init__(self, model: torch.nn.Module, apply: Callable[[WeightUpdate], None]):
        self.served = served_tensors(model)
        self._apply = apply

    def send(self, weights: Weights, version: int, *, reset: bool = False) -> None:
        """The model serves whatever version it is given, so `reset` changes nothing."""
        del reset
        self._apply(weight_update(self.served, weights, version))


def weight_update(served: dict[str, ServedTensor], weights: Weights, version: int) -> WeightUpdate:
    """An update of the tensors `served` describes to `weights`: a whole state dict (or file, or
    folder) or adapter is read and checked now, an iterable of buckets bucket by bucket as it is applied."""
    if isinstance(weights, (str, Path)):
        weights = read_adapter(weights) or read_state_dict(weights)
    if isinstance(weights, AdapterWeights):
        weights.check(served)
        return WeightUpdate(weights.deltas(), version, merge=True)
    if isinstance(weights, dict):
        check_state_dict(served, weights)
        return WeightUpdate([weights], version)
    return WeightUpdate(_checked(served, weights), version)


def _checked(served: dict[str, ServedTensor], buckets: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for bucket in buckets:
        check_state_dict(served, bucket)
        yield bucket
