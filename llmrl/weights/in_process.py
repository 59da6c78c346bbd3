"""The in-process transports: new weights for a model in this process (the embedded engine).

The engine applies an update between decode steps. Whole weights become a `WeightUpdate` of their
buckets, each checked as it is applied against the names, shapes and floating-ness of the model's
``state_dict`` as recorded when the transport was built (`served_tensors`): the Llama/Qwen2 decoder
may since have released some of the model's tensors into its fused ones. LoRA adapters are checked
whole and become an update of deltas (`merge`): the receiver serves each of its base weights plus
the delta.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from llmrl.weights.adapters import AdapterWeights
from llmrl.weights.checks import ServedTensor, check_state_dict, served_tensors
from llmrl.weights.payloads import FullWeights
from llmrl.weights.transport import P, WeightTransport, check_version


@dataclass(eq=False)
class WeightUpdate:
    buckets: Iterable[dict[str, torch.Tensor]]  # read once, when the update is applied
    version: int
    merge: bool = False
    """The buckets hold LoRA deltas to add to the base weights, not weights."""
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


ApplyUpdate = Callable[[WeightUpdate], None]
"""Hands an update to the model's owner; returns once the model holds it (raising its error)."""


class _IntoModel(WeightTransport[P]):
    """A transport into a model of this process, which serves whatever version up to `max_version`
    it is given (so `reset` changes nothing)."""

    same_device = True

    def __init__(self, served: dict[str, ServedTensor], apply: ApplyUpdate, max_version: int):
        self.served = served
        self._apply = apply
        self.max_version = max_version

    def send(self, payload: P, version: int, *, reset: bool = False) -> None:
        check_version(version, self.max_version)
        self._apply(self._update(payload, version))

    @abstractmethod
    def _update(self, payload: P, version: int) -> WeightUpdate: ...


class InProcessWeights(_IntoModel[FullWeights]):
    """Whole weights into a model of this process, checked bucket by bucket as they are applied."""

    takes = ("weights",)

    def _update(self, payload: FullWeights, version: int) -> WeightUpdate:
        return WeightUpdate(_checked(self.served, payload.buckets()), version)


class InProcessAdapters(_IntoModel[AdapterWeights]):
    """LoRA adapters onto a model of this process: checked whole, then merged as deltas."""

    takes = ("adapters",)

    def _update(self, payload: AdapterWeights, version: int) -> WeightUpdate:
        payload.check(self.served)
        return WeightUpdate(payload.deltas(), version, merge=True)


def in_process_transports(
    model: torch.nn.Module, apply: ApplyUpdate, *, max_version: int
) -> list[WeightTransport[Any]]:
    """Both in-process transports of `model`, checking updates against its tensors as they are now."""
    served = served_tensors(model)
    return [InProcessWeights(served, apply, max_version), InProcessAdapters(served, apply, max_version)]


def _checked(served: dict[str, ServedTensor], buckets: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for bucket in buckets:
        check_state_dict(served, bucket)
        yield bucket
