"""The one interface every way of moving weights implements.

A transport delivers one version of the policy to where it serves, and declares the kind of payload
it takes (`llmrl.weights.payloads`): the embedded engine in this process (`in_process`), llmrl's
inference server by a shared file or streamed (`llmrl_server`), vLLM servers by buckets in requests or
files, by NCCL broadcast (`nccl`), or as LoRA adapters they load (`llmrl.inference.vllm.transports`).
Each inference interface builds the transport its config names, once; the trainer holds it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

from llmrl.weights.payloads import Payload, PayloadKind

P = TypeVar("P", bound=Payload)


class WeightSyncError(RuntimeError):
    """A weight update failed or timed out; `status` is the server's HTTP status when it answered."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


class WeightTransport(ABC, Generic[P]):
    """Moves whole weight versions of the payload kinds it `takes` to one serving side."""

    takes: ClassVar[tuple[PayloadKind, ...]]
    same_device: ClassVar[bool] = False
    """Whether it takes the trainer's tensors on the trainer's device as they are (a receiver in this
    process); others are handed gathered weights on CPU."""

    @abstractmethod
    def send(self, payload: P, version: int, *, reset: bool = False) -> None:
        """Deliver `payload` as `version`; returns once it serves. Versions only grow unless `reset`
        is set (a trainer starting or resuming a run owns the sequence); the served version again
        is a no-op for receivers that keep versions."""

    def before_update(self) -> None:
        """The trainer is about to update the policy (the next `send` follows it): a receiver that
        shares the trainer's device may release memory until then (colocated vLLM sleeps)."""


class WrongPayloadError(WeightSyncError):
    """A payload of a kind the receiving side was not set up for."""


_KIND_WORDS: dict[PayloadKind, str] = {"weights": "whole weights", "adapters": "LoRA adapters"}


def transport_for(transports: list[WeightTransport[Any]], kind: PayloadKind, where: str) -> Any:
    """The first of `transports` that takes `kind`, or `WrongPayloadError` naming what `where` (the
    receiving side, in words) serves instead."""
    for transport in transports:
        if kind in transport.takes:
            return transport
    served = " or ".join(_KIND_WORDS[k] for t in transports for k in t.takes) or "no weights"
    raise WrongPayloadError(f"{where} serves {served}, not {_KIND_WORDS[kind]}")


def check_version(version: Any, maximum: int | None = None) -> None:
    """Refuse (ValueError) anything but an integer version >= 0 (and <= `maximum` when given)."""
    wanted = ">= 0" if maximum is None else f"in 0..{maximum}"
    too_large = maximum is not None and isinstance(version, int) and version > maximum
    if isinstance(version, bool) or not isinstance(version, int) or version < 0 or too_large:
        raise ValueError(f"version must be an integer {wanted}, got {version!r}")
