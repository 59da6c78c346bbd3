"""The trainer's LoRA side (`model.lora`): adapters built with peft over the frozen base, what a sync
sends (`AdapterWeights`), the checkpoint's adapter folder, and the merged model ``llmrl export`` writes.

peft wraps the model in a ``PeftModel``; the trainer trains the transformers model inside it (its
linear layers replaced by LoRA layers in place), which `token_logprobs` takes as it takes any causal
LM, and keeps the wrapper for what only it does: switching the adapters off for the KL reference,
and PEFT's adapter names and config.

Under torchrun the transformers model is sharded with FSDP2 like a fully trained one
(`llmrl.trainer.distributed`): each decoder layer's unit holds its frozen base weights and its
adapters, and only the adapters get gradients, so only theirs are reduced. (FSDP2 needs one dtype
among a unit's trainable parameters only: float32 adapters beside a bfloat16 base are fine.)
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from llmrl.config import LoraConfig
from llmrl.models import load_model
from llmrl.models.loading import DTYPES, write_model_folder
from llmrl.weights.adapters import ADAPTER_FILE, AdapterWeights

ADAPTER_FOLDER = "adapter"
"""A LoRA checkpoint's adapter, in PEFT's format (the base model is the run's `model.spec`)."""


class Adapters:
    """LoRA adapters over a frozen model: `model` is what trains (adapters included)."""

    def __init__(self, model: torch.nn.Module, lora: LoraConfig):
        """Wrap `model` (in the compute dtype, frozen from here on) with float32 adapters, drawn from
        torch's global generator as peft initialises them (A random, B zero: the policy starts as the base)."""
        import peft

        config = peft.LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
        self.peft_model = peft.get_peft_model(model, config)
        for parameter in self.trainable():
            parameter.data = (
                parameter.data.float()
            )  # what peft does for a 16-bit base; float32 whatever the base
        self.model: torch.nn.Module = self.peft_model.get_base_model()

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.peft_model.parameters() if p.requires_grad]

    def summary(self) -> str:
        """How many parameters train, and their share of the model."""
        trainable = sum(p.numel() for p in self.trainable())
        total = sum(p.numel() for p in self.peft_model.parameters())
        return (
            f"LoRA: {trainable:,} of {total:,} parameters train ({100 * trainable / total:.2f}%); "
            f"the base ({total - trainable:,}) is frozen"
        )

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model's forward while inside (the KL reference: no second copy; no-grad passes).

        The adapters keep ``requires_grad``, which peft clears while they are off: FSDP2 settles at
        a model's first pass which parameters train (and so their gradients' dtype), and this pass
        may be the first."""
        trainable = self.trainable()
        with self.peft_model.disable_adapter():
            for parameter in trainable:
                parameter.requires_grad_(True)
            yield

    def weights(self) -> AdapterWeights:
        """This version of the adapters as a sync payload (float32, PEFT's names and config).

        Sharded (FSDP2) adapters are gathered whole, the frozen base is not: a collective then, that
        every rank calls in step."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.peft_model)
        return AdapterWeights({name: _whole(t.detach()) for name, t in state.items()}, self.config())

    def config(self) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` content, as ``save_pretrained`` writes it."""
        config = self.peft_model.peft_config["default"].to_dict()
        return json.loads(json.dumps(config, default=lambda value: sorted(value)))  # sets become lists

    def save(self, folder: Path) -> None:
        """PEFT's adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)."""
        self.weights().save(folder)

    def load(self, folder: Path) -> None:
        """Continue from an adapter folder `save` wrote (bit for bit)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        device = str(next(self.peft_model.parameters()).device)
        set_peft_model_state_dict(self.peft_model, load_file(str(folder / ADAPTER_FILE), device=device))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def adapter_sizes(model: torch.nn.Module, lora: LoraConfig) -> tuple[int, int]:
    """(adapter parameters, parameters of the weights they adapt) of `model` (meta device is fine)."""
    adapters = Adapters(model, lora)
    layers = [m for m in adapters.model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    adapted = sum(m.base_layer.weight.numel() for m in layers)
    return sum(p.numel() for p in adapters.trainable()), adapted


def merge_adapter(
    adapter: Path, base_spec: str, output_dir: str | Path, *, dtype: str, trust_remote_code: bool = False
) -> Path:
    """A PEFT adapter folder merged into the base model `base_spec`, written in `dtype` as a plain
    Hugging Face folder; the merge is done in float32."""
    from peft import PeftModel

    base, tokenizer = load_model(base_spec, trust_remote_code=trust_remote_code)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    return write_model_folder(merged.to(DTYPES[dtype]), tokenizer, output_dir)
