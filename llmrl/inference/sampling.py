"""Next-token sampling for the embedded engine: one batched call per decode step, per-row parameters.

Every row of a decode batch is one sequence with its own temperature, min-p, top-k, top-p and
random stream. A step draws all rows' tokens with a handful of tensor ops (no per-row kernels):

0. (``penalize``, only for rows that ask) repetition and presence penalties change the logits of
   tokens seen before, as Hugging Face and vLLM define them, and `min_tokens` bans stop tokens.
1. ``probs = softmax(logits / T)`` in float32. One pass over the vocabulary instead of two
   (``log_softmax`` then ``exp``); the log of a float32 probability is within ~1e-7 of
   ``log_softmax``, and a drawn token never has probability 0 (step 3), a greedy one is the most
   likely.
2. Min-p (tokens below ``min_p`` times the row's largest probability are dropped), then top-k,
   then top-p on what is left, renormalised: on each row's probabilities sorted in descending
   order, drop ranks >= k, then every token whose higher-ranked mass already reaches ``top_p`` of
   what min-p and top-k kept (the first token is always kept); the smallest kept probability
   becomes a threshold applied in vocabulary order. Only the largest ``max(PARTIAL_SORT, top_k)``
   probabilities are ranked (``topk``) unless a top-p row keeps them all (then the whole
   vocabulary is sorted); skipped entirely when no row of the batch filters.
3. Inverse-CDF sampling with *one uniform per row*, always in vocabulary order: the token is the
   first index whose cumulative (unnormalised) probability exceeds ``u * total``. Zeroed tokens
   own an empty interval and can never be drawn.

The reported logprob is that of the distribution the token was drawn from (the semantics in
``llmrl/types.py``): ``log(probs[token])`` without filters, ``log(kept[token] / kept.sum())`` with
them; the trainer recomputes the same numbers (`llmrl.algorithms.logprobs`).

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
    """Sampling parameters of a batch's rows as tensors; rebuilt whenever the batch's rows change.

    A tensor that `sample_tokens` will not read is None (the usual batch, T=1 without top-k or
    top-p, needs none): each costs a `torch.tensor` call on every change of rows, not negligible
    beside a small model's decode step.
    """

    temperature: torch.Tensor | None
    """(B, 1) float32 divisor of the logits; 1.0 for greedy rows (their logprob is the T=1 one).
    None when `unit_temperature`."""
    greedy: torch.Tensor | None
    """(B,) bool, rows that take the argmax. None unless some rows, not all, are greedy."""
    top_k: torch.Tensor | None
    """(B, 1) int64 number of tokens kept by top-k; the vocabulary size where top-k is off.
    None unless `any_filter`."""
    top_p: torch.Tensor | None
    """(B, 1) float32 nucleus mass; +inf where top-p is off, so rounding never trims the tail.
    None unless `any_filter`."""
    min_p: torch.Tensor | None
    """(B, 1) float32 share of the largest probability a token needs; 0 where min-p is off.
    None unless some row uses min-p."""
    filtered: torch.Tensor | None
    """(B,) bool, rows whose logprobs are renormalised over the tokens they keep. None unless `any_filter`."""
    all_greedy: bool
    any_greedy: bool
    unit_temperature: bool
    """True when every row divides by 1 (T=1 or greedy): the division is skipped."""
    any_filter: bool
    """True when some row uses min-p, top-k or top-p: only then is the vocabulary filtered."""


MAX_UNIFORM = 1.0 - 2.0**-23
"""Largest uniform `sample_tokens` accepts (callers clamp their draws to it)."""


def row_sampling(args: Sequence[GenerationArgs], vocab_size: int, device: torch.device | str) -> RowSampling:
    """Tensors of the per-row parameters, one `GenerationArgs` per row (rows of a group repeat it)."""
    greedy = [a.temperature == 0.0 for a in args]
    temperature = [[1.0 if g else a.temperature] for g, a in zip(greedy, args, strict=True)]
    top_k = [a.top_k if 0 < a.top_k < vocab_size else vocab_size for a in args]
    top_p = [a.top_p if a.top_p < 1.0 else math.inf for a in args]
    min_p = [[a.min_p] for a in args]
    all_greedy, any_greedy = all(greedy), any(greedy)
    unit_temperature = all(t == [1.0] for t in temperature)
    filtered = [
        k < vocab_size or p < math.inf or m != [0.0] for k, p, m in zip(top_k, top_p, min_p, strict=True)
    ]
    any_filter, any_min_p = any(filtered), any(m != [0.0] for m in min_p)
    return RowSampling(
        temperature=None
        if unit_temperature
        else torch.tensor(temperature, dtype=torch.float32, device=device),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device)
        if any_greedy and not all_greedy
        else None,
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device)[:, None] if any_filter else None,
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device)[:, None] if any_filter else None,
        min_p=torch.tensor(min_p, dtype=torch.float32, device=device) if any_min_p else None,
        filtered=torch.tensor(filtered, dtype=torch.bool, device=device) if any_filter else None,
        all_greedy=all_greedy,
        any_greedy=any_greedy,
        unit_temperature=unit_temperature,
        any_filter=any_filter,
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
    probs = torch.softmax(scaled, dim=-1)  # (B, V), before min-p/top-k/top-p
    if rows.all_greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()
    kept = _filter(probs, rows) if rows.any_filter else probs
    cdf = kept.cumsum(dim=-1)  # (B, V), non-decreasing, so cdf[:, -1] is the total
    # u <= MAX_UNIFORM makes u * total round below total, so the pick is a token of positive
    # probability (rounding is monotone and (1 - 2^-23) * total is at least one ulp below it).
    tokens = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).squeeze(-1)
    if rows.any_greedy:
        tokens = torch.where(rows.greedy, logits.argmax(dim=-1), tokens)
    logprobs = probs.gather(-1, tokens[:, None]).squeeze(-1).log()
    if rows.any_filter:  # the drawn token's share of what its row kept (greedy rows report T=1, unfiltered)
        renormalised = kept.gather(-1, tokens[:, None]).squeeze(-1).log() - cdf[:, -1].log()
        logprobs = torch.where(
            rows.filtered & ~rows.greedy if rows.any_greedy else rows.filtered, renormalised, logprobs
        )
    return tokens, logprobs


def adjusts_logits(args: GenerationArgs) -> bool:
    """Whether a request's logits change before sampling (penalties, or stop tokens banned for a while)."""
    return args.repetition_penalty != 1.0 or args.presence_penalty != 0.0 or args.min_tokens > 0


def penalize(
    logits: torch.Tensor,
    seen: torch.Tensor,
    seen_in_completion: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    banned: torch.Tensor,
) -> torch.Tensor:
    """Penalised float32 logits (B, V) of rows that ask for penalties or `min_tokens`.

    `seen` (B, V) bool marks tokens in the prompt or completion so far, `seen_in_completion` those
    in the completion; `repetition_penalty` and `presence_penalty` are (B, 1). A seen token's logit
    is divided by the repetition penalty when positive and multiplied by it otherwise (Keskar et
    al. 2019, CTRL, as in Hugging Face and vLLM); the presence penalty is subtracted from logits of
    tokens in the completion (OpenAI's definition). `banned` (B, V) bool tokens (stop tokens before
    `min_tokens`) get -inf.
    """
    logits = logits.float()
    repeated = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
    logits = torch.where(seen, repeated, logits) - presence_penalty * seen_in_completion
    return logits.masked_fill(banned, -math.inf)


PARTIAL_SORT = 64
"""Top-k/top-p first look at each row's `PARTIAL_SORT` largest probabilities (``topk``), and sort
the whole vocabulary only when some row's kept set may reach beyond them: a full sort costs a large
share of a small model's decode step, ``topk`` a fraction of that, and a nucleus usually holds a few
tokens. A flat distribution, whose nucleus reaches beyond them, pays both. Top-p's mass is the
row's whole sum here rather than the sorted prefix sum, equal up to float32 rounding."""


def _filter(probs: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Zero the probabilities each row's min-p, then top-k/top-p, removes."""
    if rows.min_p is not None:  # a row without min-p has threshold 0, which keeps everything
        probs = probs.masked_fill(probs < rows.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return _top_k_top_p(probs, rows)


def _top_k_top_p(probs: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Zero the probabilities each row's top-k/top-p removes, keeping the vocabulary order.

    The kept set is found on sorted probabilities, then applied as a per-row threshold in
    vocabulary order: sampling then walks the same order whether or not other rows filter, which
    keeps a seeded sequence independent of its batch. Tokens tied with the threshold are kept
    (as Hugging Face's top-k does).
    """
    vocab = probs.shape[-1]
    filtered_k = rows.top_k[rows.top_k < vocab]
    head = max(PARTIAL_SORT, int(filtered_k.max()) if len(filtered_k) else 0)
    if head < vocab:
        # top-k never cuts beyond `head`; a row without top-p keeps everything (threshold 0);
        # a top-p row that keeps all `head` ranks may keep more: then sort everything.
        threshold, kept = _threshold(probs.topk(head, dim=-1).values, probs.sum(dim=-1, keepdim=True), rows)
        no_top_p = rows.top_p == math.inf
        if not bool(((kept == head) & ~no_top_p & (rows.top_k > head)).any()):
            threshold = threshold.masked_fill(no_top_p & (rows.top_k == vocab), 0.0)
            return probs.masked_fill(probs < threshold, 0.0)
    threshold, _ = _threshold(probs.sort(dim=-1, descending=True).values, None, rows)
    return probs.masked_fill(probs < threshold, 0.0)


def _threshold(
    ordered: torch.Tensor, total: torch.Tensor | None, rows: RowSampling
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest kept probability (B, 1) and the number of ranks kept (B, 1), from each row's
    largest probabilities in descending order (B, R). `total` (B, 1) is each row's whole mass,
    None when `ordered` holds the whole vocabulary."""
    ranks = torch.arange(ordered.shape[-1], device=ordered.device)
    in_top_k = ranks < rows.top_k  # (B, R)
    ordered = ordered.masked_fill(~in_top_k, 0.0)
    cumulative = ordered.cumsum(dim=-1)
    # Mass top-k keeps: the prefix up to rank k, or the whole mass where top-k is off.
    kept_mass = (
        cumulative[:, -1:]
        if total is None
        else torch.where(rows.top_k <= ordered.shape[-1], cumulative[:, -1:], total)
    )
    # Keep a token while the mass ranked above it is below top_p of what top-k kept: the smallest
    # prefix whose mass reaches top_p. The first token is always kept.
    # Rounding in the cumulative sum can put the first token's mass-above a hair over a tiny top_p:
    # rank 0 is kept explicitly, or a row would keep nothing.
    keep = in_top_k & ((cumulative - ordered < rows.top_p * kept_mass) | (ranks == 0))
    kept = keep.sum(dim=-1, keepdim=True)
    return ordered.gather(-1, kept - 1), kept
