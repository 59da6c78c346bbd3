"""Per-token logprobs (and entropies) of sampled tokens, without materialising vocab x tokens at once.

For target token ``y_t`` predicted from hidden state ``h_{t-1}``::

    z        = (W h_{t-1} + b) / temperature     float32 logits, [V]
    logprob  = log_softmax(z)[y_t]                the same number the inference engine reports
    entropy  = -sum_v p_v log p_v, p = softmax(z)  entropy of the distribution sampled from

(`llmrl.types`: logprobs are those of the distribution the token was sampled from, in float32, so
trainer and engine agree.) The sampling options may differ per token (`SamplingParams`: each
rollout's temperature, min-p, top-k, top-p). With min-p/top-k/top-p the distribution is
renormalised over the tokens they keep, found as the engine finds them (`kept_tokens`: min-p on
``softmax(z)``, then top-k, then top-p on what is left), plus the target itself, which the engine
did draw: a token on the boundary that float rounding moves out of the kept set changes that
token's normaliser by its own small mass instead of making its logprob -inf.

The naive ``log_softmax(logits).gather(...)`` holds a float32 ``[tokens, vocab]`` tensor twice (the
logits and their log-softmax), plus whatever autograd saves: at 32k vocab and 4k tokens that is
0.5 GB per copy. Here the tokens are cut into chunks; each chunk's logits are computed from the hidden
states with the LM head (so the full logits never exist), reduced to one logprob (and entropy) per
token, and dropped. Under autograd each chunk is checkpointed when there are several: only its
hidden states are kept, and its logits are recomputed in the backward pass (one extra LM-head
matmul per chunk, the usual price of "selective log-softmax" / fused linear-cross-entropy kernels).
Peak memory therefore scales with ``chunk_size x vocab``, not ``tokens x vocab``; a single chunk
keeps what autograd saves (a few copies of at most `CHUNK_ELEMENTS` logits) instead of recomputing.

`token_logprobs` runs a Hugging Face causal LM on a `llmrl.algorithms.packing.PackedBatch` and keeps
only the tokens in its loss mask (for on-policy distillation's top-k signal, `token_top_k` keeps a
teacher's k likeliest tokens there too, and `token_logprobs_and_teacher_kl` computes the policy's
reverse KL to them from the same chunks of logits as its logprobs); `selective_log_softmax` and `logprobs_from_hidden` are the pure
tensor functions underneath. Models whose logits are not plain ``lm_head(hidden)`` (Gemma 2's
final soft-capping ``c tanh(z / c)``, Cohere's scale, Granite's divisor) get the same transform
(`logit_transform`), applied in float32, before the temperature.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from llmrl.algorithms.distillation import teacher_top_k, top_k_reverse_kl
from llmrl.algorithms.packing import PackedBatch, has_local_attention
from llmrl.algorithms.varlen import attends_by_sequence, boundary_kwargs

CHUNK_ELEMENTS = 2**24
"""Default chunk budget in logits: 16M float32 values = 64 MB (512 tokens at a 32k vocab)."""


@dataclass(frozen=True)
class SamplingParams:
    """How each token was sampled, as tensors of one shape (``[N]`` per token, or ``[R, T]`` laid out
    like a `PackedBatch` for `token_logprobs`). A filter that no token uses is None."""

    temperature: torch.Tensor
    """float32, > 0."""
    top_k: torch.Tensor | None = None
    """int64 tokens kept by top-k; 0 where it is off."""
    top_p: torch.Tensor | None = None
    """float32 nucleus mass; 1 where it is off."""
    min_p: torch.Tensor | None = None
    """float32 share of the largest probability a token needs; 0 where it is off."""

    @property
    def filters(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SamplingParams:
        """`fn` applied to every tensor (indexing, slicing, moving to a device)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return SamplingParams(
            **{name: None if value is None else fn(value) for name, value in values.items()}
        )


def kept_tokens(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[n, V]`` bool, the tokens min-p, then top-k, then top-p keep (the engine's order, by a full sort).

    `probs` is ``[n, V]`` (``softmax(logits / T)``), `params` has ``[n]`` tensors. Top-p keeps the
    smallest prefix of the sorted remaining tokens whose mass reaches ``top_p`` of what min-p and
    top-k kept; ties with the smallest kept probability are kept.
    """
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.min_p is not None:
        keep = probs >= params.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    ordered = probs.masked_fill(~keep, 0.0).sort(dim=-1, descending=True).values  # (n, V)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    ranked = keep.sum(dim=-1, keepdim=True) > ranks  # the min-p survivors lead the order
    if params.top_k is not None:
        ranked &= (params.top_k[:, None] == 0) | (ranks < params.top_k[:, None])
    if params.top_p is not None:
        ordered = ordered.masked_fill(~ranked, 0.0)
        cumulative = ordered.cumsum(dim=-1)
        mass_above = cumulative - ordered
        ranked &= (params.top_p[:, None] >= 1) | (mass_above < params.top_p[:, None] * cumulative[:, -1:])
    smallest = ordered.gather(-1, ranked.sum(dim=-1, keepdim=True) - 1)  # (n, 1)
    return keep & (probs >= smallest)


def selective_log_softmax(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | SamplingParams = 1.0,
    *,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(logits / temperature)`` at `targets`, chunked over tokens.

    Args:
        logits: ``[..., V]`` in any float dtype (computed in float32).
        targets: ``[...]`` token ids.
        temperature: one temperature, or per-token `SamplingParams` shaped like `targets`.
        with_entropy: also return the entropy of each token's full distribution.
        chunk_size: tokens per chunk; None sizes chunks to `CHUNK_ELEMENTS` logits.
    Returns ``(logprobs, entropies)``, both float32 shaped like `targets` (entropies None unless asked).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets has shape {tuple(targets.shape)}, logits need {tuple(logits.shape[:-1])}")
    flat_logprobs, flat_entropies, _ = _chunked(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        lambda x: x,
        logits.shape[-1],
        _flat(temperature),
        with_entropy,
        chunk_size,
    )
    return flat_logprobs.view(targets.shape), _view_or_none(flat_entropies, targets.shape)


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | SamplingParams = 1.0,
    *,
    lm_head_bias: torch.Tensor | None = None,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like `selective_log_softmax` of ``transform(hidden @ lm_head_weight.T + bias)``, applying the
    LM head per chunk so the ``[..., V]`` logits are never all in memory.

    Args:
        hidden: ``[..., H]`` final hidden states (after the model's last norm).
        lm_head_weight: ``[V, H]``.
        targets: ``[...]`` token ids.
        transform: what the model does to its float32 logits (`logit_transform`); None: nothing.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets has shape {tuple(targets.shape)}, hidden needs {tuple(hidden.shape[:-1])}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be [vocab, {hidden.shape[-1]}], got {tuple(lm_head_weight.shape)}"
        )
    flat_logprobs, flat_entropies, _ = _chunked(
        hidden.reshape(-1, hidden.shape[-1]),
        targets.reshape(-1),
        _lm_head(lm_head_weight, lm_head_bias, transform),
        lm_head_weight.shape[0],
        _flat(temperature),
        with_entropy,
        chunk_size,
    )
    return flat_logprobs.view(targets.shape), _view_or_none(flat_entropies, targets.shape)


def token_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float | SamplingParams = 1.0,
    *,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of `batch`'s tokens under a Hugging Face causal LM.

    The model sees ``input_ids`` and ``position_ids`` and, unless the batch shares prefixes, no
    attention mask: transformers then reads packed sequences from the position ids restarting at 0
    and builds a block-diagonal causal mask (SDPA/eager) or variable-length kernels (flash attention).
    A batch with shared prefixes brings its own mask (SDPA or eager attention only); see
    `llmrl.algorithms.packing`.

    `temperature` is one number, or `SamplingParams` of ``[R, T]`` tensors laid out like the batch:
    each token's own sampling options (the trainer gives each token its sequence's).

    Returns ``[R, T]`` float32 tensors aligned with ``batch.input_ids``: entry ``t`` is the logprob
    of token ``t`` given the tokens before it in its sequence, filled in where ``batch.loss_mask`` is
    True and 0 elsewhere (the LM head only runs on those tokens).
    """
    logprobs, entropies, _ = _token_stats(model, batch, temperature, with_entropy, chunk_size)
    return logprobs, entropies


def token_logprobs_and_teacher_kl(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float | SamplingParams,
    teacher_logprobs: torch.Tensor,
    teacher_ids: torch.Tensor,
    *,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`token_logprobs`, and at each token the reverse KL from the model's distribution to a teacher's
    top-k (`llmrl.algorithms.distillation.top_k_reverse_kl`) from the same logits: ``[R, T]`` each.

    `teacher_logprobs` ``[R, T, k + 1]`` and `teacher_ids` ``[R, T, k]`` are `token_top_k`'s, laid out
    like the batch. `temperature` as for `token_logprobs`, without sampling filters (the KL compares
    whole distributions).
    """
    return _token_stats(model, batch, temperature, with_entropy, chunk_size, (teacher_logprobs, teacher_ids))


@torch.no_grad()
def token_top_k(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float | SamplingParams,
    k: int,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A teacher's view of `batch`: the logprob of each token ``[R, T]`` (as `token_logprobs`), and its
    distribution there cut to its `k` likeliest tokens (`llmrl.algorithms.distillation.teacher_top_k`):
    logprobs ``[R, T, k + 1]`` (the last, the rest of the vocabulary) and ids ``[R, T, k]``, zero off the
    loss mask. `temperature` and `chunk_size` as for `token_logprobs`, without sampling filters (the
    teacher's whole distribution is kept)."""
    if isinstance(temperature, SamplingParams) and temperature.filters:
        raise ValueError("a teacher's top k is of its whole distribution: sampling filters do not apply")
    hidden, rows, columns, lm_head = _masked_hidden(model, batch)
    to_logits = _lm_head(lm_head.weight, lm_head.bias, logit_transform(model.config))
    divisors = temperature if isinstance(temperature, int | float) else temperature.temperature[rows, columns]
    targets = batch.input_ids[rows, columns]
    k = min(k, lm_head.weight.shape[0])
    chunk_size = chunk_size or max(1, CHUNK_ELEMENTS // lm_head.weight.shape[0])
    pieces = []
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, hidden.shape[0], chunk_size):
            stop = start + chunk_size
            divisor = divisors if isinstance(divisors, int | float) else divisors[start:stop, None]
            log_probs = torch.log_softmax(to_logits(hidden[start:stop]).float() / divisor, dim=-1)
            pieces.append(
                (log_probs.gather(-1, targets[start:stop, None])[:, 0], *teacher_top_k(log_probs, k))
            )
    shape = batch.loss_mask.shape
    logprobs = torch.zeros(shape, device=hidden.device)
    grouped = torch.zeros((*shape, k + 1), device=hidden.device)
    ids = torch.zeros((*shape, k), dtype=torch.int64, device=hidden.device)
    if pieces:
        logprobs[rows, columns] = torch.cat([p[0] for p in pieces])
        grouped[rows, columns] = torch.cat([p[1] for p in pieces])
        ids[rows, columns] = torch.cat([p[2] for p in pieces])
    return logprobs, grouped, ids


def _token_stats(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float | SamplingParams,
    with_entropy: bool,
    chunk_size: int | None,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-token logprobs, entropies (None unless asked) and teacher KLs (0 without a `teacher`), ``[R, T]``."""
    hidden, rows, columns, lm_head = _masked_hidden(model, batch)
    # The LM head runs in its weight's dtype even under autocast: float32 master weights give
    # float32 logits, as without autocast.
    with torch.autocast(hidden.device.type, enabled=False):
        logprobs, entropies, teacher_kl = _chunked(
            hidden,
            batch.input_ids[rows, columns],  # (N,)
            _lm_head(lm_head.weight, lm_head.bias, logit_transform(model.config)),
            lm_head.weight.shape[0],
            temperature
            if isinstance(temperature, int | float)
            else temperature.map(lambda t: t[rows, columns]),
            with_entropy,
            chunk_size,
            None if teacher is None else (teacher[0][rows, columns], teacher[1][rows, columns]),
        )
    placed = torch.zeros(batch.loss_mask.shape, dtype=logprobs.dtype, device=logprobs.device)
    return (
        placed.index_put((rows, columns), logprobs),
        None if entropies is None else placed.index_put((rows, columns), entropies),
        placed if teacher_kl is None else placed.index_put((rows, columns), teacher_kl),
    )


def _masked_hidden(
    model: torch.nn.Module, batch: PackedBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.nn.Module]:
    """The final hidden states ``[N, H]`` that predict the loss-mask tokens (in the LM head's dtype), the
    rows and columns of those tokens, and the LM head."""
    _check_causal_lm(model)
    lm_head = model.get_output_embeddings()
    hidden = model.base_model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        attention_mask=_attention_mask(model, batch, lm_head.weight.dtype),
        use_cache=False,
        **(boundary_kwargs(batch.position_ids) if attends_by_sequence(model) else {}),
    ).last_hidden_state  # (R, T, H)
    rows, columns = batch.loss_mask.nonzero(as_tuple=True)
    return (
        hidden[rows, batch.context_positions[rows, columns]].to(lm_head.weight.dtype),
        rows,
        columns,
        lm_head,
    )


# ---------------------------------------------------------------------------------------------
# Helpers


def _chunked(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    to_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab: int,
    temperature: float | SamplingParams,
    with_entropy: bool,
    chunk_size: int | None,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Apply `_chunk_stats` to ``[N, D]`` inputs `chunk_size` rows at a time and concatenate.

    ``chunk_size=None`` picks ``CHUNK_ELEMENTS // vocab`` tokens per chunk. `teacher`: ``[N, k + 1]``
    logprobs and ``[N, k]`` ids of a teacher's top k, for the reverse KL to it (None without).
    """
    lowest = (
        temperature
        if isinstance(temperature, int | float)
        else (temperature.temperature.min().item() if temperature.temperature.numel() else 1.0)
    )
    if not lowest > 0:
        raise ValueError(f"temperature must be > 0 for logprobs, got {lowest}")
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // vocab)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (or None), got {chunk_size}")

    def stats(x: torch.Tensor, y: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
        params = (
            temperature
            if isinstance(temperature, int | float)
            else temperature.map(lambda t: t[start : start + chunk_size])
        )
        scored = None if teacher is None else tuple(t[start : start + chunk_size] for t in teacher)
        return _chunk_stats(to_logits(x), y, params, with_entropy, scored)

    pieces = []
    # A single chunk is not checkpointed: what autograd keeps of it is bounded by the chunk budget,
    # and recomputing it would cost a noticeable share of a small model's update.
    recompute = torch.is_grad_enabled() and inputs.shape[0] > chunk_size
    # max(N, 1): an empty input still runs once, so the result has the right dtype and graph.
    for start in range(0, max(inputs.shape[0], 1), chunk_size):
        x, y = inputs[start : start + chunk_size], targets[start : start + chunk_size]
        if recompute:
            # Keep only this chunk's inputs; recompute its logits during backward.
            pieces.append(checkpoint(stats, x, y, start, use_reentrant=False))
        else:
            pieces.append(stats(x, y, start))
    logprobs = torch.cat([p[0] for p in pieces])
    entropies = torch.cat([p[1] for p in pieces]) if with_entropy else None
    teacher_kl = torch.cat([p[-1] for p in pieces]) if teacher is not None else None
    return logprobs, entropies, teacher_kl


def _chunk_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | SamplingParams,
    with_entropy: bool,
    teacher: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Logprob of each target (then its entropy, then its reverse KL to `teacher`'s top k, each when
    asked) for one chunk of ``[n, V]`` logits."""
    divisor = temperature if isinstance(temperature, int | float) else temperature.temperature[:, None]
    log_probs = torch.log_softmax(logits.float() / divisor, dim=-1)  # (n, V), only this chunk
    if isinstance(temperature, SamplingParams) and temperature.filters:
        if teacher is not None:
            raise ValueError("a teacher's KL compares whole distributions: sampling filters do not apply")
        with torch.no_grad():
            keep = kept_tokens(log_probs.exp(), temperature)
            keep[torch.arange(len(targets), device=keep.device), targets] = True  # the engine drew it
        kept = log_probs.masked_fill(~keep, -math.inf)
        log_probs = kept - kept.logsumexp(dim=-1, keepdim=True)  # renormalised over the kept tokens
    stats = [log_probs.gather(-1, targets[:, None]).squeeze(-1)]
    if with_entropy:
        # clamp: a -inf logit (a banned token) has p = 0 and must add 0, not 0 * -inf = NaN.
        stats.append(-(log_probs.exp() * log_probs.clamp(min=torch.finfo(log_probs.dtype).min)).sum(-1))
    if teacher is not None:
        stats.append(top_k_reverse_kl(log_probs, *teacher))
    return tuple(stats)


def _flat(temperature: float | SamplingParams) -> float | SamplingParams:
    return temperature if isinstance(temperature, int | float) else temperature.map(lambda t: t.reshape(-1))


def _view_or_none(values: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    return None if values is None else values.view(shape)


def _attention_mask(model: torch.nn.Module, batch: PackedBatch, dtype: torch.dtype) -> torch.Tensor | None:
    """`batch`'s attention mask in the form the model's attention kernel takes, or None (plain causal).

    For SDPA it is additive (0 or -inf) in the dtype attention runs in, made once per batch: given a
    boolean mask, or none for packed rows, each layer's SDPA call would make its own float copy and
    keep it for the backward pass (gigabytes over a real-size model's layers with long packed rows).
    """
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    mask = batch.attention_mask
    if mask is None and implementation == "sdpa" and not has_local_attention(model.config):
        # transformers' own mask of packed rows is boolean (each layer's SDPA call would copy it); its
        # eager mask is already additive, and sliding windows need its masks per layer type
        mask = _packed_causal_mask(batch.position_ids)
    if mask is None:
        return None
    if implementation == "sdpa":
        device = mask.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)
    if implementation == "eager":  # adds the mask to the scores
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    raise ValueError(
        f"a batch with shared prefixes needs the sdpa or eager attention; this model uses {implementation!r} "
        "(set training.share_prefixes: false)"
    )


def _packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``[R, 1, T, T]`` bool block-diagonal causal mask of rows packing several sequences (position ids
    restart at each sequence's start, as transformers reads them); None when no row packs more than one."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    sequence = starts.cumsum(dim=1)  # (R, T) which sequence of its row each token belongs to
    width = position_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=position_ids.device).tril()
    return ((sequence[:, :, None] == sequence[:, None, :]) & causal)[:, None]


def logit_transform(config: object) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a model's ``...ForCausalLM.forward`` does to ``lm_head(hidden)``, per its config; None: nothing.

    transformers' models read these config attributes: ``final_logit_softcapping`` c (Gemma 2 and
    3: ``c tanh(z / c)``), ``logit_scale`` s (Cohere: ``s z``), ``logits_scaling`` d (Granite: ``z / d``).
    """
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    divisor = getattr(config, "logits_scaling", None)
    steps = []
    if cap is not None:
        steps.append(lambda z: torch.tanh(z / cap) * cap)
    if scale not in (None, 1, 1.0):
        steps.append(lambda z: z * scale)
    if divisor not in (None, 1, 1.0):
        steps.append(lambda z: z / divisor)
    if not steps:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        for step in steps:
            logits = step(logits)
        return logits

    return transform


def _lm_head(
    weight: torch.Tensor, bias: torch.Tensor | None, transform: Callable[[torch.Tensor], torch.Tensor] | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    if transform is None:
        return lambda x: F.linear(x, weight, bias)
    return lambda x: transform(F.linear(x, weight, bias).float())


def _check_causal_lm(model: torch.nn.Module) -> None:
    if model.get_output_embeddings() is None or model.base_model is model:
        raise ValueError(
            f"token_logprobs needs a causal LM with an output embedding (a ...ForCausalLM), got {type(model).__name__}"
        )
