"""Model runners of the embedded engine: prefill prompts, decode one token per row, drop rows.

The engine (``engine.py``) owns scheduling and sampling; a decoder owns the model and its KV
cache. Rows are the sequences of the running batch; the engine keeps its list of sequences in the
decoder's row order (``remove_rows`` returns the new order). This module holds the `Decoder`
protocol, `build_decoder`, which picks one, and the generic fallback:

* `LlamaFamilyDecoder` (``llama_decoder.py``; Llama, Qwen2): its own KV cache (``kv_cache.py``)
  and a forward pass in plain torch ops (``llama_forward.py``), rows of every request batched in
  one step, a GRPO group's long prompt kept once. It keeps the q/k/v and gate/up projections
  fused in tensors of its own, which replace the model's when the engine owns the model.
* `PagedLlamaDecoder` (``static_decode.py``; the same models, with ``inference.cuda_graphs: on``):
  a paged KV cache and a decode step over fixed buffers, replayed as CUDA graphs on a GPU.
* `HFDecoder` (any other causal LM): the model's own forward with one transformers
  ``DynamicCache`` per prompt group (prefilled once, repeated to ``n`` rows), one forward per group
  per step. Slower (no batching across requests), but works for every architecture with a cache.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from transformers import DynamicCache

from llmrl.config import ConfigError
from llmrl.inference.kv_cache import max_positions
from llmrl.inference.llama_decoder import LlamaFamilyDecoder
from llmrl.inference.merging import MergedWeights
from llmrl.inference.static_decode import PagedLlamaDecoder

__all__ = ["CudaGraphs", "Decoder", "HFDecoder", "LlamaFamilyDecoder", "PagedLlamaDecoder", "build_decoder"]

CudaGraphs = Literal["auto", "on", "off"]


class Decoder(Protocol):
    """A model with a KV cache of `num_rows` sequences."""

    num_rows: int
    vocab_size: int
    max_positions: int
    cache_bytes: int
    """Bytes of KV cache currently allocated."""

    def prefill(
        self, prompts: list[list[int]], copies: list[int], max_new_tokens: list[int] | None = None
    ) -> torch.Tensor:
        """Append `copies[i]` rows for prompt i (in order); return each prompt's next-token logits (N, V).

        `max_new_tokens[i]`: the most tokens prompt i's rows will generate (None: unknown), so the
        cache never grows beyond what its rows can reach."""
        ...

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (B,); return next-token logits (B, V)."""
        ...

    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        """Next-token logits at every position of `prompt` (P, V), the rows and their cache untouched."""
        ...

    def remove_rows(self, rows: list[int]) -> list[int]:
        """Drop `rows`; return the old index of each remaining row, in the new row order."""
        ...

    def reset(self) -> None:
        """Drop every row (the cache's memory may stay allocated for the next batch)."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Serve the tensors of `state` (the model's state-dict names, checked; a subset changes only
        those)."""
        ...

    def merge_deltas(self, deltas: dict[str, torch.Tensor]) -> None:
        """Serve, for each weight named, the weight it served before its first merge plus the delta
        (LoRA's ``scaling * B @ A``, checked): a new adapter version replaces the previous one."""
        ...


def build_decoder(
    model: torch.nn.Module,
    *,
    max_rows: int | None = None,
    owns_model: bool = False,
    cuda_graphs: CudaGraphs = "off",
    reserve_tokens: int = 8192,
) -> Decoder:
    """`LlamaFamilyDecoder` where the architecture allows it (`max_rows`: how far its row capacity
    doubles; `owns_model`: it may release the model's tensors it keeps fused), else the generic
    `HFDecoder`. With `cuda_graphs` ``on``, the paged, static decoder (`PagedLlamaDecoder`,
    ``static_decode.py``, its pool first sized for `reserve_tokens`): graphed on CUDA, the same
    function run eagerly elsewhere. ``auto`` is ``off`` until graphs have run on a card."""
    if cuda_graphs == "on":
        if not LlamaFamilyDecoder.supports(model):
            raise ConfigError(
                "inference.cuda_graphs: on needs a Llama or Qwen2 model (the compact decoder); "
                f"{type(model).__name__} runs on the generic decoder: set inference.cuda_graphs: off"
            )
        return PagedLlamaDecoder(
            model, max_rows=max_rows, owns_model=owns_model, reserve_tokens=reserve_tokens
        )
    if LlamaFamilyDecoder.supports(model):
        return LlamaFamilyDecoder(model, max_rows=max_rows, owns_model=owns_model)
    return HFDecoder(model)


@dataclass
class _Group:
    cache: DynamicCache
    rows: int


class HFDecoder:
    """Any transformers causal LM: one cache per prompt group, one `model(...)` call per group per step."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().out_features
        self.max_positions = max_positions(model.config)
        self.groups: list[_Group] = []
        self._merged = MergedWeights()
        # transformers 5.x renamed `past_key_values` to `cache` (the old name goes in 5.40); remote-code
        # models may keep the old one.
        self._cache_argument = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    @property
    def num_rows(self) -> int:
        return sum(g.rows for g in self.groups)

    @property
    def cache_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for group in self.groups
            for layer in group.cache.layers
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if isinstance(t, torch.Tensor)
        )

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Into the model itself, which every step calls."""
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)
        self._merged.replaced(state)

    def merge_deltas(self, deltas: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, delta in deltas.items():
                self._merged.merge(name, self.model.get_parameter(name), delta.to(self.device, torch.float32))

    def reset(self) -> None:
        self.groups = []

    def prefill(
        self, prompts: list[list[int]], copies: list[int], max_new_tokens: list[int] | None = None
    ) -> torch.Tensor:
        del max_new_tokens  # transformers' caches grow by themselves
        logits = []
        for prompt, count in zip(prompts, copies, strict=True):
            ids = torch.tensor([prompt], device=self.device)
            cache = DynamicCache(config=self.model.config)  # filled in place by the forward
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_argument: cache})
            if count > 1:
                cache.batch_repeat_interleave(count)
            self.groups.append(_Group(cache, count))
            logits.append(out.logits[0, -1])
        return torch.stack(logits)

    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        return self.model(input_ids=torch.tensor([prompt], device=self.device)).logits[0]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        logits, start = [], 0
        for group in self.groups:
            ids = tokens[start : start + group.rows, None]  # (n, 1)
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_argument: group.cache})
            logits.append(out.logits[:, -1])
            start += group.rows
        return torch.cat(logits)

    def remove_rows(self, rows: list[int]) -> list[int]:
        removed, order, start, groups = set(rows), [], 0, []
        for group in self.groups:
            keep = [i for i in range(group.rows) if start + i not in removed]
            order.extend(start + i for i in keep)
            start += group.rows
            if len(keep) < group.rows and keep:
                group.cache.batch_select_indices(torch.tensor(keep, device=self.device))
                group.rows = len(keep)
            if keep:
                groups.append(group)
        self.groups = groups
        return order
