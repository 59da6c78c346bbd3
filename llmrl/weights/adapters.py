"""LoRA adapters as a weight payload: what a sync of a LoRA-trained policy moves instead of its weights.

`AdapterWeights` holds each adapted module's A and B matrices under PEFT's names
(``base_model.model.<module>.lora_A.weight``) and PEFT's adapter config (``adapter_config.json``).
On disk it is PEFT's own folder (``adapter_config.json`` + ``adapter_model.safetensors``), or, for
one file sent to a server, the safetensors file with the config in its metadata (`ADAPTER_METADATA`).
A receiver that serves merged weights adds `deltas` (``scaling * B @ A`` under the base weight's
name) to its copy of the base weights; the base itself never moves. This module imports only torch
and safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from llmrl.weights.buckets import layer_key
from llmrl.weights.checks import ServedTensor, weight_problem

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_METADATA = "llmrl_adapter_config"
"""Safetensors metadata key of a one-file adapter: its PEFT config as JSON."""
_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True)
class AdapterWeights:
    """One version of a policy's LoRA adapters (PEFT names and config): a weight payload
    (`llmrl.weights.payloads`)."""

    kind: ClassVar[Literal["adapters"]] = "adapters"
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    path: Path | None = None
    """The PEFT folder or one-file adapter it was read from, if any."""

    @property
    def scaling(self) -> float:
        """What PEFT multiplies B @ A by: alpha / r (alpha / sqrt(r) with rank-stabilised LoRA)."""
        rank = self.config["r"]
        return self.config["lora_alpha"] / (rank**0.5 if self.config.get("use_rslora") else rank)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def file_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The adapter as one safetensors file: its tensors, its PEFT config in the metadata."""
        return self.tensors, self.file_metadata()

    def file_metadata(self) -> dict[str, str]:
        """Safetensors metadata that makes a file of `tensors` a one-file adapter (`read_adapter`)."""
        return {ADAPTER_METADATA: json.dumps(self.config)}

    def drain(self) -> None:
        """Nothing is produced on demand: the tensors are all here."""

    def modules(self) -> list[str]:
        """The adapted modules' names in the base model (``model.layers.0.self_attn.q_proj``), in order."""
        return [name[len(_PREFIX) : -len(_A)] for name in self.tensors if name.endswith(_A)]

    def pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensors[f"{_PREFIX}{module}{_A}"], self.tensors[f"{_PREFIX}{module}{_B}"]

    def deltas(self) -> Iterator[dict[str, torch.Tensor]]:
        """``{base weight name: scaling * B @ A}`` in float32, one decoder layer at a time (a layer's
        deltas are as large as its weights; the whole model's at once would be a second copy)."""
        layer: dict[str, torch.Tensor] = {}
        key = None
        for module in self.modules():
            module_key = layer_key(module)
            if layer and module_key != key:
                yield layer
                layer = {}
            key = module_key
            a, b = self.pair(module)
            layer[f"{module}.weight"] = (b.float() @ a.float()) * self.scaling
        if layer:
            yield layer

    def check(self, served: dict[str, ServedTensor]) -> None:
        """Refuse (ValueError) an adapter that does not fit the served model's weights: every module's
        A (r, in) and B (out, r) must exist, match the weight it adapts and be finite."""
        names = set(self.tensors)
        modules = self.modules()
        expected = {f"{_PREFIX}{m}{suffix}" for m in modules for suffix in (_A, _B)}
        if names != expected or not modules:
            stray = sorted(names - expected)[:3]
            raise ValueError(f"adapter: names that are not lora_A/lora_B pairs of a module: {stray}")
        for module in modules:
            target = served.get(f"{module}.weight")
            if target is None or len(target.shape) != 2:
                raise ValueError(f"adapter: {module!r} is not a linear layer of the served model")
            a, b = self.pair(module)
            rank = a.shape[0]
            for name, tensor, shape in (
                (f"{module}{_A}", a, (rank, target.shape[1])),
                (f"{module}{_B}", b, (target.shape[0], rank)),
            ):
                problem = weight_problem(name, tensor, shape)
                if problem:
                    raise ValueError(f"adapter: {problem}")

    # -- files -----------------------------------------------------------------------------------

    def save(self, folder: str | Path) -> Path:
        """Write PEFT's adapter folder (loadable by ``PeftModel.from_pretrained`` and vLLM)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(_contiguous(self.tensors), str(folder / ADAPTER_FILE), metadata={"format": "pt"})
        (folder / ADAPTER_CONFIG).write_text(json.dumps(self.config, indent=2, sort_keys=True) + "\n")
        return folder


def read_adapter(path: str | Path) -> AdapterWeights | None:
    """The adapter a PEFT folder or a one-file adapter holds; None when `path` holds plain weights."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        if not (path / ADAPTER_CONFIG).is_file():
            return None
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        return AdapterWeights(load_file(str(path / ADAPTER_FILE)), config, path)
    if path.suffix != ".safetensors":
        return None
    with safe_open(str(path), "pt") as file:
        metadata = file.metadata() or {}
    if ADAPTER_METADATA not in metadata:
        return None
    return AdapterWeights(load_file(str(path)), json.loads(metadata[ADAPTER_METADATA]), path)


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
