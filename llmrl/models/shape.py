"""A model's shape: its sizes (parameters, layers, attention) and the FLOPs of its forward pass.

One home for what the memory plan, the trainer's packing costs and the benchmarks' FLOP counts
read of a model config, so that they never disagree about a head's width or which weights a token
is multiplied by; and which state-dict names alias another's tensor (tied embeddings), so that
whatever stores or sends weights does so once per tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def head_dim(config: Any) -> int:
    """Channels per attention head: the config's `head_dim`, else hidden size / attention heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Parameter counts and layer sizes of a decoder-only model, and the FLOPs they imply."""

    parameters: int
    largest_block: int
    """Parameters of the largest decoder layer (FSDP2 gathers one or two at a time)."""
    outside_blocks: int
    """Parameters outside the decoder layers (embeddings, final norm, LM head)."""
    layers: int
    hidden: int
    intermediate: int
    kv_channels: int
    """Key (or value) channels per token and layer: kv heads x head dim."""
    vocab: int
    body: int
    """Parameters outside the input embeddings and the LM head: those every token is multiplied by."""
    lm_head: int
    """Parameters of the LM head (as many again when it shares the input embeddings' weights)."""
    attention_width: int
    """Query channels per token and layer: attention heads x head dim."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        """The shape of `model`, which may live on the meta device."""
        config = model.config
        names = set(getattr(model, "_no_split_modules", None) or ())
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        block_sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
        unique = {id(p): p.numel() for p in model.parameters()}
        embeddings = {
            id(p)
            for module in (model.get_input_embeddings(), model.get_output_embeddings())
            if module is not None
            for p in module.parameters()
        }
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
        experts_per_token = getattr(config, "num_experts_per_tok", None) or 1
        return cls(
            parameters=sum(unique.values()),
            largest_block=max(block_sizes, default=0),
            outside_blocks=sum(unique.values()) - sum(block_sizes),
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=intermediate * experts_per_token,
            kv_channels=kv_heads * head_dim(config),
            vocab=config.vocab_size,
            body=sum(size for key, size in unique.items() if key not in embeddings),
            lm_head=model.get_output_embeddings().weight.numel(),
            attention_width=heads * head_dim(config),
        )

    @property
    def token_flops(self) -> float:
        """Forward FLOPs per token outside attention and the LM head: 2 per weight of the body."""
        return 2.0 * self.body

    @property
    def pair_flops(self) -> float:
        """Forward FLOPs per (query, key) pair of attention: q.k and the weighted sum of v, 2 x 2 per
        query channel and layer."""
        return 4.0 * self.layers * self.attention_width

    def attention_flops(self, queries: int, context_before: int = 0) -> float:
        """Attention FLOPs of `queries` consecutive causal positions after `context_before` others."""
        return self.pair_flops * (queries * context_before + queries * (queries + 1) / 2)


def tied_duplicates(model: torch.nn.Module) -> set[str]:
    """State-dict names that alias an earlier entry's tensor (tied embeddings): a Hugging Face folder
    stores each tensor once. Aliases are one and the same parameter, on a sharded or meta model too."""
    first_names = registered_names(model)
    return {name for name in model.state_dict(keep_vars=True) if first_names.get(name, name) != name}


def registered_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's and buffer's name -> the first name under which the same tensor is registered."""
    first: dict[int, str] = {}
    names = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names[name] = first.setdefault(id(tensor), name)
    return names
