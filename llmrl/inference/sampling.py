"""Next-token sampling for the embedded engine: one batched call per decode step, per-row parameters.

Every row of a decode batch is one sequence with its own temperature, top-k, top-p and random
stream. A step draws all rows' tokens with a handful of tensor ops (no per-row kernels):

1. ``logprobs = log_softmax(logits / T)`` in float32, *before* any filtering. This is the logprob
   the engine reports for the chosen token (the semantics in ``llmrl/types.py``), so trainer and
   inference logprobs of the same weights agree.
2. Top-k, then top-p on the top-k-renormalised distribution (the order of Hugging Face's logits
   warpers): on each row's probabilities sorted in descending order, drop ranks >= k, then every
   token whose higher-ranked mass already reaches ``top_p`` of what top-k kept (the first token is
   always kept); the smallest kept probability becomes a threshold applied in vocabulary order.
   Skipped entirely (no sort) when no row of the batch filters.
3. Inverse-CDF sampling with *one uniform per row*, always in vocabulary order: the token is the
   first index whose cumulative (unnormalised) probability exceeds ``u * total``. Zeroed tokens
   own an empty interval and can never be drawn.

Why one uniform per row from the sequence's own generator: the draw of a sequence depends only on
its own logits and its own seed, never on which other rows share the batch, so a seeded request
gives the same tokens alone or beside 30 others. (Its logits themselves can differ in the last
float bits between batch shapes, because BLAS blocks a 1-row and a 31-row matmul differently; a
token flips only if a uniform lands within that rounding of an interval boundary, about 1e-6 per
token.) Gumbel-max would need a full vocabulary of noise per row and step; a single uniform needs
one Python float.

Greedy rows (temperature 0) take the argmax of the raw logits, exactly as ``generate(do_sample=
False)`` does, and report the temperature-1 logprob ``log_softmax(logits)[token]``: the logprob of
the same token under the unscaled policy, finite and comparable across requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmrl.types import GenerationArgs


@dataclass(frozen=True)
class RowSampling:
    """Sampling parameters of a batch's rows as tensors; rebuilt whenever the batch's rows change."""

    temperature: torch.Tensor
    """(B, 1) float32 divisor of the logits; 1.0 for greedy rows (their logprob is the T=1 one)."""
    greedy: torch.Tensor
    """(B,) bool, rows that take the argmax."""
    top_k: torch.Tensor
    """(B, 1) int64 number of tokens kept by top-k; the vocabulary size where top-k is off."""
    top_p: torch.Tensor
    """(B, 1) float32 nucleus mass; +inf where top-p is off, so rounding never trims the tail."""
    all_greedy: bool
    any_greedy: bool
    unit_temperature: bool
    """True when every row divides by 1 (T=1 or greedy): the division is skipped."""
    any_filter: bool
    """True when some row uses top-k or top-p: only then is the vocabulary sorted."""


MAX_UNIFORM = 1.0 - 2.0**-23
"""Largest uniform `sample_tokens` accepts (callers clamp their draws to it)."""


def row_sampling(args: Sequence[GenerationArgs], vocab_size: int, device: torch.device | str) -> RowSampling:
    """Tensors of the per-row parameters, one `GenerationArgs` per row (rows of a group repeat it)."""
    greedy = [a.temperature == 0.0 for a in args]
    top_k = [a.top_k if 0 < a.top_k < vocab_size else vocab_size for a in args]
    top_p = [a.top_p if a.top_p < 1.0 else math.inf for a in args]
    return RowSampling(
        temperature=torch.tensor([[1.0 if g else a.temperature] for g, a in zip(greedy, args, strict=True)],
                                 dtype=torch.float32, device=device),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device)[:, None],
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device)[:, None],
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        unit_temperature=all(g or a.temperature == 1.0 for g, a in zip(greedy, args, strict=True)),
        any_filter=any(k < vocab_size for k in top_k) or any(p < math.inf for p in top_p),
    )


def sample_tokens(
    logits: torch.Tensor, rows: RowSampling, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (tokens (B,) int64, logprobs (B,) float32).

    `logits` is (B, V) in any float dtype; `uniforms` is (B,) float32 in [0, MAX_UNIFORM]
    (ignored for greedy rows).
    """
    logits = logits.float()  # (B, V)
    scaled = logits if rows.unit_temperature else logits / rows.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)  # (B, V), before top-k/top-p
    if rows.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _inverse_cdf(logprobs.exp(), rows, uniforms)
        if rows.any_greedy:
            tokens = torch.where(rows.greedy, logits.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, rows: RowSampling, uniforms: torch.Tensor) -> torch.Tensor:
    """(B,) token ids drawn from `probs` (B, V) after each row's top-k/top-p, one uniform per row."""
    if rows.any_filter:
        probs = _top_k_top_p(probs, rows)
    cdf = probs.cumsum(dim=-1)  # (B, V), non-decreasing, so cdf[:, -1] is the total
    # u <= MAX_UNIFORM makes u * total round below total, so the pick is a token of positive
    # probability (rounding is monotone and (1 - 2^-23) * total is at least one ulp below it).
    return torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).squeeze(-1)


def _top_k_top_p(probs: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Zero the probabilities each row's top-k/top-p removes, keeping the vocabulary order.

    The kept set is found on sorted probabilities, then applied as a per-row threshold in
    vocabulary order: sampling then walks the same order whether or not other rows filter, which
    keeps a seeded sequence independent of its batch. Tokens tied with the threshold are kept
    (as Hugging Face's top-k does).
    """
    ordered = probs.sort(dim=-1, descending=True).values  # (B, V)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    in_top_k = ranks < rows.top_k  # (B, V)
    ordered = ordered.masked_fill(~in_top_k, 0.0)
    cumulative = ordered.cumsum(dim=-1)
    # Keep a token while the mass ranked above it is below top_p of what top-k kept: the smallest
    # prefix whose mass reaches top_p. The first token is always kept.
    keep = in_top_k & (cumulative - ordered < rows.top_p * cumulative[:, -1:])
    threshold = ordered.gather(-1, keep.sum(dim=-1, keepdim=True) - 1)  # (B, 1) smallest kept probability
    return probs.masked_fill(probs < threshold, 0.0)
