"""`LlamaFamilyDecoder`: the embedded engine's decoder for Llama and Qwen2 models.

It owns a `KVCache` (``kv_cache.py``) and runs `LlamaForward` (``llama_forward.py``), a forward
pass in plain torch ops on the model's weights. Why not ``model(...)`` with a transformers cache
class: continuous batching has rows of different lengths joining and leaving between steps and
groups sharing one prompt, while a ``DynamicCache`` appends every row at one shared position, so
each join or leave would re-pad the cache; and the per-step work is smaller
(``bench/generation.py`` prints one 64-row step against ``model(...)`` + ``DynamicCache``).
transformers' own continuous-batching manager (``generate_batch``, paged attention) runs on CPU
but is far slower than ``generate`` on the GRPO workload of ``bench/generation.py``, and has one
seed per manager, not per request.

Prefill decides per group where its prompt goes. Decode attention is memory-bound (it reads the
cache), so a long prompt with many samples is kept once in the shared cache and attended by
cascade attention. A short prompt (below ``SHARE_FROM``) is copied into each of its rows instead,
where four ops per layer attend to it, cheaper than the cascade's dozen; when no shared group is
running, decode takes that path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from llmrl.inference.kv_cache import KVCache, list_tensor, max_positions
from llmrl.inference.llama_forward import (
    FusedRows,
    LlamaForward,
    SharedPrompts,
    fused_rows,
    prompt_mask,
    read_weights,
    rotation_table,
)
from llmrl.inference.merging import MergedWeights
from llmrl.models.shape import head_dim

SUPPORTED_FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""`config.model_type` values served by `LlamaFamilyDecoder`, with transformers' class of each
(a remote-code model of the same type may compute something else)."""
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
"""Rotary scalings `LlamaFamilyDecoder` takes from the model's own rotary module once: their
frequencies do not depend on the sequence."""


class LlamaFamilyDecoder:
    """Batched decoding for Llama-architecture models, group prompts shared when it pays (module
    docstring)."""

    SHARE_FROM = 768
    """A group keeps one copy of its prompt once sharing saves this many cached prompt tokens,
    ``len(prompt) * (n - 1)``; smaller groups copy the prompt into each row. The value is the
    crossover on the tiny model: below it the cascade's extra ops cost more than reading the prompt
    once saves (a small batch whose cache fits in L2 gains little from reading less)."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        config = getattr(model, "config", None)
        model_class = SUPPORTED_FAMILIES.get(getattr(config, "model_type", None))
        if type(model).__name__ != model_class or not type(model).__module__.startswith("transformers."):
            return False
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
            return False  # sliding-window layers need a windowed mask this cache does not build
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type not in STATIC_ROPE:
            return False  # e.g. frequencies that change with the sequence length; the table here is fixed
        inner = getattr(model, "model", None)
        return all(
            hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")
        ) and hasattr(model, "lm_head")

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_rows: int | None = None,
        share_from: int = SHARE_FROM,
        owns_model: bool = False,
    ):
        """`max_rows` caps how far row capacity doubles (rows beyond it are still served);
        `share_from` overrides `SHARE_FROM`. With `owns_model`, the model's q/k/v and gate/up
        weights and biases are released once read into the fused tensors (`release_fused_originals`)."""
        assert self.supports(model)
        config = model.config
        self.model = model
        self.share_from = share_from
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.max_positions = max_positions(config)
        first = next(model.parameters())
        self.device = first.device
        self.vocab_size = model.lm_head.out_features
        self.forward = LlamaForward(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            eps=model.model.norm.variance_epsilon,
            act_fn=model.model.layers[0].mlp.act_fn,
        )
        self.cache = self._new_cache(config, first, max_rows)
        self._positions = torch.empty(
            0, device=self.device, dtype=torch.int64
        )  # 0, 1, ...: spans are its slices
        self._rotation = torch.empty(
            0, self.head_dim // 2, device=self.device, dtype=torch.complex64
        )  # by position
        self.fused: dict[str, FusedRows] = fused_rows(model, self.num_heads, self.num_kv_heads, self.head_dim)
        self.weights = read_weights(model, self.fused)
        self._merged = MergedWeights()
        self.released: frozenset[str] = frozenset()
        """State-dict names whose only copy is in the fused tensors (the model holds meta placeholders)."""
        if owns_model:
            release_fused_originals(model, self.fused)
            self.released = frozenset(self.fused)

    def _new_cache(self, config, first: torch.Tensor, max_rows: int | None) -> KVCache:
        """The KV cache the rows live in, of `first`'s device and dtype."""
        return KVCache(
            num_layers=config.num_hidden_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_positions=self.max_positions,
            device=first.device,
            dtype=first.dtype,
            max_rows=max_rows,
        )

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """q/k/v and gate/up tensors written into their rows of the fused tensors (and into the model's
        own parameters while it holds them), every other tensor into the model, whose tensors the
        forward reads as they are."""
        with torch.no_grad():
            self.model.load_state_dict(
                {k: v for k, v in state.items() if k not in self.released}, strict=False
            )
            for name, value in state.items():
                rows = self.fused.get(name)
                if rows is not None:
                    rows.write(self.weights, value)
        self._merged.replaced(state)

    def merge_deltas(self, deltas: dict[str, torch.Tensor]) -> None:
        """Serve base + delta for each weight named (`MergedWeights`), in the fused rows or the model."""
        with torch.no_grad():
            for name, delta in deltas.items():
                rows = self.fused.get(name)
                delta = delta.to(device=self.device, dtype=torch.float32)
                if rows is None:
                    self._merged.merge(name, self.model.get_parameter(name), delta)
                else:
                    self._merged.merge(name, rows.rows(self.weights), rows.in_layout(delta))

    def reset(self) -> None:
        self.cache.reset()

    @property
    def num_rows(self) -> int:
        return self.cache.num_rows

    @property
    def cache_bytes(self) -> int:
        return self.cache.cache_bytes

    def remove_rows(self, rows: list[int]) -> list[int]:
        return self.cache.remove_rows(rows)

    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        """Next-token logits at every position of `prompt` (P, V), the cache untouched."""
        self._grow_rotation(len(prompt))
        ids = torch.tensor([prompt], device=self.device)
        x = self.forward.residual(self.weights, ids, self._rotation[: len(prompt), None], None, _keep_nothing)
        return self.forward.logits(x, self.weights)

    def _reserve(self, which: str, entries: int, length: int, reach: int | None = None) -> None:
        """`KVCache.reserve`, and the rotary table grown to every position the rows may then reach."""
        self.cache.reserve(which, entries, length, reach)
        self._grow_rotation(max(self.cache.shared_lengths, default=0) + length)

    def _grow_rotation(self, positions: int) -> None:
        if positions > self._rotation.shape[0]:
            table = min(
                max(positions, 2 * self._rotation.shape[0], KVCache.CAPACITY_STEP), self.max_positions
            )
            self._positions = torch.arange(table, device=self.device)
            self._rotation = rotation_table(self.model, table, self.head_dim, self.device)  # (table, D/2)

    def prefill(
        self, prompts: list[list[int]], copies: list[int], max_new_tokens: list[int] | None = None
    ) -> torch.Tensor:
        cache = self.cache
        num_prompts = len(prompts)
        first_group, first_row = cache.num_groups, cache.num_rows
        share = [n > 1 and len(p) * (n - 1) >= self.share_from for p, n in zip(prompts, copies, strict=True)]
        # Where each prompt's keys/values go: the shared cache (one entry per group) or the rows.
        shared_src = [i for i, s in enumerate(share) if s]
        inline_src = [
            i for i, (s, n) in enumerate(zip(share, copies, strict=True)) if not s for _ in range(n)
        ]
        inline_rows = [
            first_row + r
            for r, i in enumerate(i for i, n in enumerate(copies) for _ in range(n))
            if not share[i]
        ]
        shared_width = max((len(prompts[i]) for i in shared_src), default=0)
        inline_width = max((len(prompts[i]) for i in inline_src), default=0)
        if shared_src or cache.shared_k is not None:  # once it exists, every group has a slot in it
            self._reserve("shared", first_group + num_prompts, shared_width)  # the grid's height
        # Row caches too: a sample can finish on its first token and leave before any decode step.
        reach = [
            self.max_positions if new_tokens is None else (0 if shared else len(prompt)) + new_tokens
            for prompt, count, shared, new_tokens in zip(
                prompts, copies, share, max_new_tokens or [None] * num_prompts, strict=True
            )
            for _ in range(count)
        ]
        self._reserve(
            "row",
            first_row + sum(copies),
            max([*cache.cached, inline_width]) + 1,
            max([*cache.reach, *reach]),
        )
        # (prompt index, cache entry, positions to write) per destination
        destinations = (
            (
                torch.tensor(shared_src, device=self.device),
                torch.tensor([first_group + i for i in shared_src], device=self.device),
                shared_width,
                "shared",
            ),
            (
                torch.tensor(inline_src, device=self.device),
                torch.tensor(inline_rows, device=self.device),
                inline_width,
                "row",
            ),
        )

        def write(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            for source, target, length, which in destinations:
                if len(source):
                    getattr(cache, f"{which}_k")[layer, target, :, :length] = keys[source, :, :length]
                    getattr(cache, f"{which}_v")[layer, target, :, :length] = values[source, :, :length]

        logits = self._padded_prefill(prompts, write)
        cache.add_groups([len(p) for p in prompts], copies, share, reach)
        return logits

    def _padded_prefill(
        self, prompts: list[list[int]], write: Callable[[int, torch.Tensor, torch.Tensor], None]
    ) -> torch.Tensor:
        """`LlamaForward.prefill` of `prompts` right-padded to the longest, under a mask where their
        lengths differ; `write` stores each layer's keys and values."""
        num_prompts, width = len(prompts), max(len(p) for p in prompts)
        padded = [token for p in prompts for token in (*p, *[0] * (width - len(p)))]
        values = list_tensor([*padded, *(len(p) for p in prompts)], torch.int64, self.device)
        ids, lengths = values[: num_prompts * width].view(num_prompts, width), values[num_prompts * width :]
        same_length = all(len(p) == width for p in prompts)
        mask = None if same_length else prompt_mask(lengths, torch.arange(width, device=self.device))
        return self.forward.prefill(self.weights, ids, lengths, self._rotation[:width, None], mask, write)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        cache, index = self.cache, self.cache.index
        assert tokens.shape == (cache.num_rows,)
        self._reserve("row", cache.num_rows, max(cache.cached) + 1, max(cache.reach))
        # Each row attends its cached positions plus the new token, which `LlamaForward.step`
        # then writes at position `cached`, inside the capacity just reserved. At least one
        # (masked) position, for a first step whose rows cached nothing of their own.
        span = max([*cache.cached, 1])
        shared = None
        if any(cache.shared_lengths):
            shared = SharedPrompts(
                cache.shared_k,
                cache.shared_v,
                self._positions[: max(cache.shared_lengths)],
                index.shared,
                index.grid,
                index.group,
                index.slot,
            )
        logits = self.forward.step(
            self.weights,
            tokens,
            index.cached,
            self._positions[:span],
            self._rotation,
            _RowCaches(cache.row_k, cache.row_v, span, index.cached),
            shared,
        )
        cache.advance()
        return logits


class _RowCaches(NamedTuple):
    """`RowCache` over `KVCache`'s row tensors: row i's positions are row i of the row caches."""

    keys: torch.Tensor  # (layers, rows_cap, kv_heads, capacity, D)
    values: torch.Tensor
    span: int
    cached: torch.Tensor  # (B,) each row's cached tokens: where its new key goes

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.cached.shape[0]
        return self.keys[layer, :rows, :, : self.span], self.values[layer, :rows, :, : self.span]

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        # All layers' new keys and values in one write each: (B, layers, kv_heads, D).
        index = torch.arange(self.cached.shape[0], device=self.cached.device)
        self.keys[:, index, :, self.cached] = keys
        self.values[:, index, :, self.cached] = values


def _keep_nothing(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A prefill's `write` when the keys and values are not cached (scoring a prompt)."""


def release_fused_originals(model: torch.nn.Module, fused: dict[str, FusedRows]) -> None:
    """Replace each parameter `fused` names by a meta tensor of its shape and dtype, so that the
    fused tensors replace the originals rather than add to them (about two thirds of each decoder
    layer's bytes). The model's own forward no longer runs; its other tensors are kept."""
    for name in fused:
        module_name, _, kind = name.rpartition(".")
        module = model.get_submodule(module_name)
        original = getattr(module, kind)
        setattr(
            module,
            kind,
            torch.nn.Parameter(
                torch.empty_like(original, device="meta"), requires_grad=original.requires_grad
            ),
        )
