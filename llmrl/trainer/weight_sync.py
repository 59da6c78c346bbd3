"""The policy's side of a weight sync: what each sync sends, produced the way this run's mode needs,
and the transport that carries it (`llmrl.weights`).

One `WeightsSource` per run knows the mode: one process sends its state dict as one bucket, FSDP2
shards are gathered bucket by bucket (every process takes part in each bucket; those with an
inference side hold it), and a LoRA run sends its adapters alone. `WeightSync` holds the source and,
on each process with an inference side (rank 0's, or each process's colocated engine), the transport
that inference interface built for the source's payload kind.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any, ClassVar

import torch

from llmrl.inference import InferenceInterface, InferenceUnavailableError
from llmrl.rollouts import unavailable_line
from llmrl.trainer.distributed import Distributed
from llmrl.trainer.lora import Adapters
from llmrl.weights import AdapterWeights, FullWeights, Payload, PayloadKind, WeightTransport


class WeightsSource(ABC):
    """The policy's current weights as the payload of one sync."""

    kind: ClassVar[PayloadKind]

    @abstractmethod
    def payload(self, into: WeightTransport[Any] | None) -> Payload:
        """This sync's payload, for `into` to read in this process (None: this process only takes
        part in producing it)."""


class PolicyWeights(WeightsSource):
    """One process: the policy's state dict, without names that alias another entry (tied embeddings)."""

    kind = "weights"

    def __init__(self, policy: torch.nn.Module, tied_names: Collection[str]):
        self.policy = policy
        self.tied_names = tied_names

    def payload(self, into: WeightTransport[Any] | None) -> FullWeights:
        state = self.policy.state_dict()
        return FullWeights.of({name: value for name, value in state.items() if name not in self.tied_names})


class ShardedPolicyWeights(WeightsSource):
    """FSDP2 shards gathered bucket by bucket in the compute dtype: every process reads every bucket
    (a collective); one whose transport reads it holds it, where that transport takes tensors
    (`WeightTransport.same_device`: on this process's device, else on CPU)."""

    kind = "weights"

    def __init__(
        self,
        policy: torch.nn.Module,
        distributed: Distributed,
        *,
        tied_names: Collection[str],
        bucket_bytes: int,
        dtype: torch.dtype,
    ):
        self.policy = policy
        self.distributed = distributed
        self.tied_names = tied_names
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype

    def payload(self, into: WeightTransport[Any] | None) -> FullWeights:
        held_on = None if into is None else self.distributed.device if into.same_device else "cpu"
        buckets = self.distributed.gathered_buckets(
            self.policy, self.bucket_bytes, held_on=held_on, skip=self.tied_names, dtype=self.dtype
        )
        return FullWeights(buckets)


class PolicyAdapters(WeightsSource):
    """A LoRA run: the adapters alone (gathered whole on every process when sharded); the base never moves."""

    kind = "adapters"

    def __init__(self, adapters: Adapters):
        self.adapters = adapters

    def payload(self, into: WeightTransport[Any] | None) -> AdapterWeights:
        return self.adapters.weights()


def weights_source(
    policy: torch.nn.Module,
    *,
    adapters: Adapters | None,
    distributed: Distributed | None,
    tied_names: Collection[str],
    bucket_bytes: int,
    compute_dtype: torch.dtype,
) -> WeightsSource:
    """The source this run's mode needs (LoRA, FSDP2 shards, or one process)."""
    if adapters is not None:
        return PolicyAdapters(adapters)
    if distributed is not None:
        return ShardedPolicyWeights(
            policy, distributed, tied_names=tied_names, bucket_bytes=bucket_bytes, dtype=compute_dtype
        )
    return PolicyWeights(policy, tied_names)


class WeightSync:
    """Serves the policy's weights on the inference side: `inference` is this process's (None on a
    process without one, which only takes part in producing the payload)."""

    def __init__(self, source: WeightsSource, inference: InferenceInterface | None):
        self.source = source
        self.inference = inference
        self.transport: WeightTransport[Any] | None = (
            inference.weight_transport(source.kind) if inference is not None else None
        )
        self.bytes_sent = 0
        """Bytes of the last sync's payload."""

    def before_update(self) -> None:
        """Tell the inference side that the policy is about to change (`WeightTransport.before_update`)."""
        if self.transport is not None:
            self.transport.before_update()

    def sync(self, version: int, *, reset: bool = False) -> None:
        """Serve the current weights as `version`. A failure while the inference side is unreachable
        becomes `InferenceUnavailableError` (one line: rerunning resumes)."""
        payload = self.source.payload(self.transport)
        if self.transport is not None:
            started = time.time()
            try:
                self.transport.send(payload, version, reset=reset)
            except Exception as exc:
                assert self.inference is not None
                if self.inference.health().unreachable_since is None:
                    raise
                detail = f"weight sync of step {version}: {type(exc).__name__}: {exc}"
                raise InferenceUnavailableError(unavailable_line(self.inference, detail, started)) from exc
        payload.drain()  # every process gathers every bucket, the transport's unread ones included
        self.bytes_sent = payload.nbytes
