"""Attention over packed rows by their sequence boundaries, without a dense mask (`VARLEN`).

A packed row holds several sequences whose position ids restart at 0 (`llmrl.algorithms.packing`).
The SDPA and eager kernels keep them apart with a ``[R, 1, T, T]`` mask, whose memory and wasted
work grow with the square of the row. Here each sequence is a span ``[cu[i], cu[i + 1])`` of the
flattened tokens, found where the position ids do not go up by one (and at each row's start), and
attention runs within spans: on CUDA through torch's variable-length flash attention
(`torch.nn.attention.varlen.varlen_attn`, which has a backward); elsewhere through
`reference_attention`, causal SDPA span by span, which gives the same numbers as the masked path and
checks the bookkeeping on a CPU.

``model.attn_implementation: varlen`` asks for it (the trainer's forwards; the embedded engine keeps
its own decoder). Shared prefixes cannot be written as spans, so it runs with
``training.share_prefixes: false``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

VARLEN = "llmrl_varlen"
"""The name transformers knows the kernel by (`register`)."""


def attends_by_sequence(model: object) -> bool:
    """Whether `model` (a transformers model, or anything with a ``config``) runs `VARLEN` attention."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == VARLEN


def sequence_boundaries(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``cu`` (int32, ``[S + 1]``) of the sequences in rows ``[R, T]`` flattened row after row, and the
    longest one's length. A sequence starts at each row's start and wherever the position id is not the
    one before it plus one (a row's padding continues its last sequence, as `build_batch` lays it out)."""
    rows, width = position_ids.shape
    flat = position_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    starts[::width] = True
    first = starts.nonzero()[:, 0]
    cu = torch.cat([first, first.new_tensor([rows * width])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def reference_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Causal attention within each span of `cu`: ``query [N, H, D]``, ``key/value [N, H_kv, D]`` ->
    ``[N, H, D]``, one SDPA call per sequence (what the CUDA kernel computes, in plain torch)."""
    groups = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    bounds = cu.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        q = query[start:stop].transpose(0, 1)  # (H, L, D)
        k = key[start:stop].transpose(0, 1).repeat_interleave(groups, dim=0)
        v = value[start:stop].transpose(0, 1).repeat_interleave(groups, dim=0)
        out[start:stop] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)
    return out


@functools.cache
def _varlen_options(grouped: bool) -> tuple[dict[str, Any], bool]:
    """Keyword arguments making torch's `varlen_attn` causal (and grouped-query where asked and it can),
    and whether the caller must repeat the key/value heads itself; read once per process."""
    from torch.nn.attention.varlen import varlen_attn

    parameters = inspect.signature(varlen_attn).parameters
    # Causality is a window (-1, 0) in newer torch, a flag in older.
    options: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    if grouped and "enable_gqa" in parameters:
        options["enable_gqa"] = True
    return options, grouped and "enable_gqa" not in parameters


def attend_spans(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    longest: int,
    scale: float | None,
) -> torch.Tensor:
    """Causal attention within each span of `cu` (int32), ``query [N, H, D]``, ``key/value [N, H_kv,
    D]`` -> ``[N, H, D]``: torch's flash kernel on CUDA (half precision), `reference_attention`
    elsewhere."""
    if not query.is_cuda:
        return reference_attention(query, key, value, cu, scale)
    from torch.nn.attention.varlen import varlen_attn

    options, repeat = _varlen_options(query.shape[1] != key.shape[1])
    if repeat:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return varlen_attn(query, key, value, cu, cu, longest, longest, scale=scale, **options)


def boundary_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments a model's forward passes down to `varlen_attention`, so that the sequence
    boundaries are found once per forward rather than once per layer."""
    cu, longest = sequence_boundaries(position_ids)
    return {"cu_seq_lens_q": cu, "max_length_q": longest}


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (``query [B, H, T, D]``, ``key/value [B, H_kv, T, D]``
    -> ``[B, T, H, D]``), attending within the sequences the layer's ``position_ids`` mark."""
    if attention_mask is not None:
        raise ValueError(
            "attn_implementation varlen takes no attention mask (shared prefixes need "
            "training.share_prefixes: false)"
        )
    if dropout:
        raise ValueError("attn_implementation varlen has no dropout (the trainer runs none)")
    batch, heads, width, dim = query.shape
    if "cu_seq_lens_q" in kwargs:  # `boundary_kwargs`, from the caller
        cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    else:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(width, device=query.device).expand(batch, width)
        cu, longest = sequence_boundaries(position_ids.to(query.device))
    flat_query = query.transpose(1, 2).reshape(batch * width, heads, dim)
    flat_key = key.transpose(1, 2).reshape(batch * width, key.shape[1], dim)
    flat_value = value.transpose(1, 2).reshape(batch * width, value.shape[1], dim)
    out = attend_spans(flat_query, flat_key, flat_value, cu, longest, scaling)
    return out.reshape(batch, width, heads, dim), None


def register() -> None:
    """Make `VARLEN` a name transformers' models take as their ``attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention)
