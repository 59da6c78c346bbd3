"""What a weight sync carries: one version of a policy, as whole weights or as LoRA adapters.

A run produces one kind of payload (`kind`) at every sync, and each transport declares the kind it
takes (`WeightTransport.takes`), so a receiver never has to find out what it was handed:

- `FullWeights`: whole weights as ordered buckets of whole decoder layers, read once;
- `AdapterWeights` (`llmrl.weights.adapters`): LoRA adapters, which serve added to the base weights
  the receiver loaded (never to the previous version's).

`payload_from` is the one place that turns what a caller may pass to ``update_weights`` (a state dict,
a file or folder, an iterable of buckets) into a payload. This module imports only torch and
safetensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import torch

from llmrl.weights.adapters import AdapterWeights, read_adapter
from llmrl.weights.buckets import read_state_dict, tensor_bytes

PayloadKind = Literal["weights", "adapters"]


class Payload(Protocol):
    """One weight version in transit (`FullWeights` or `AdapterWeights`)."""

    kind: ClassVar[PayloadKind]

    @property
    def path(self) -> Path | None:
        """The file or folder it was read from, if any: a receiver sharing that disk may be sent the
        path instead of the tensors."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors (of `FullWeights`: those read so far)."""
        ...

    def file_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Every tensor and the safetensors metadata that make the payload one file."""
        ...

    def drain(self) -> None:
        """Produce whatever a receiver left unread (a sharded policy's buckets are collectives that
        every process takes part in)."""
        ...


class FullWeights:
    """One version of whole weights: buckets that together hold every tensor once, each bucket whole
    decoder layers (so that fused pieces such as q/k/v and gate/up travel together).

    The buckets may be produced on demand (a sharded policy gathers each from every process), so
    they are read in order, at most once (`buckets`), and a receiver keeps no bucket longer than it
    needs; the version serves once the last bucket is in. A receiver reads them to the end unless it
    fails or has nothing to do (the version it already serves); the producer then `drain`s the rest.
    """

    kind: ClassVar[PayloadKind] = "weights"

    def __init__(self, buckets: Iterable[dict[str, torch.Tensor]], *, path: Path | None = None):
        self.path = path
        self.nbytes = 0
        self._stream = self._counted(buckets)

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> FullWeights:
        """A whole state dict as one bucket."""
        return cls([state])

    @classmethod
    def read(cls, path: str | Path) -> FullWeights:
        """The weights of a safetensors or torch file, or of a folder of them, read when first asked for."""
        path = Path(path)
        if not path.exists():
            raise ValueError(f"weights: {path} is neither a file nor a folder")
        return cls(_read(path), path=path)

    def buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """The buckets not read yet, in order (one stream: asking again continues it)."""
        return self._stream

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The remaining buckets as one dict (for receivers that take one file or one broadcast)."""
        return {name: tensor for bucket in self._stream for name, tensor in bucket.items()}

    def file_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        return self.state_dict(), {}

    def drain(self) -> None:
        for _ in self._stream:
            pass

    def _counted(self, buckets: Iterable[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        for bucket in buckets:
            self.nbytes += sum(tensor_bytes(bucket).values())
            yield bucket


def _read(path: Path) -> Iterator[dict[str, torch.Tensor]]:
    yield read_state_dict(path)


def payload_from(value: Any) -> FullWeights | AdapterWeights:
    """The payload `value` stands for: a payload as it is; a state dict (one bucket); a PEFT adapter
    folder or one-file adapter; a safetensors/torch file or a folder of them; an iterable of bucket
    dicts."""
    if isinstance(value, (FullWeights, AdapterWeights)):
        return value
    if isinstance(value, dict):
        return FullWeights.of(value)
    if isinstance(value, (str, Path)):
        return read_adapter(value) or FullWeights.read(value)
    return FullWeights(value)
