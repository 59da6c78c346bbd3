"""The GRPO-family policy loss: clipped surrogate, KL to a reference, entropy bonus, IS correction.

Per completion token ``t`` of sequence ``i`` with advantage ``A`` and ratio ``r = pi(y_t) / pi_old(y_t)``
(``pi_old``: the trainer's policy before the step's first update; see `llmrl.trainer.optimization`),
the loss to *minimise* is::

    pg_t = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)         PPO, Schulman et al. 2017
    pg_t = min(pg_t, -c * A)  where A < 0                                  dual clip, Ye et al. 2020
    l_t  = w_t * pg_t + kl_beta * KL_t - entropy_coef * H_t                w_t: IS weight (1 without)

- PPO clipped surrogate: "Proximal Policy Optimization Algorithms", arXiv:1707.06347, eq. 7.
  Asymmetric ranges ``clip_low`` / ``clip_high`` are DAPO's clip-higher (Yu et al. 2025,
  arXiv:2503.14476, section 3.1): a larger upper range lets unlikely tokens grow, against entropy collapse.
- Dual clip ("Mastering Complex Control in MOBA Games with Deep RL", arXiv:1912.09729): for negative
  advantages the unclipped ``-r * A`` grows without bound as ``r`` grows; cap it at ``-c * A``.
- ``ratio_level="sequence"`` is GSPO (Zheng et al. 2025, arXiv:2507.18071): one length-normalised
  ratio per sequence, ``s_i = exp(mean_t log(pi / pi_old))``, clipped as a whole. We use the
  GSPO-token form ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` whose value is ``s_i`` and whose gradient
  equals GSPO's when advantages are per sequence, and which also accepts per-token advantages.
- KL to the reference policy, per token with ``log rho = log pi_ref - log pi`` (Schulman, "Approximating
  KL Divergence", 2020, http://joschu.net/blog/kl-approx.html)::

      k1 = -log rho                 unbiased, high variance, can be negative
      k2 = (log rho)^2 / 2          biased, low variance
      k3 = (rho - 1) - log rho      unbiased, low variance, always >= 0 (GRPO, DeepSeekMath eq. 4)

  The samples come from ``pi_old``, not ``pi``, so the gradient of ``KL_t`` alone is not that of the
  KL: ``kl_ratio_weighted`` uses ``r * KL_t`` instead, whose gradient is the unbiased reverse-KL
  gradient even on-policy, where ``r`` is 1 but its gradient is not (DeepSeek-AI 2025,
  "DeepSeek-V3.2", arXiv:2512.02556, unbiased KL estimate; TRL's ``use_bias_correction_kl``).
- Entropy bonus: ``H_t`` is the entropy of the full next-token distribution (from
  `llmrl.algorithms.logprobs`), weighted by ``entropy_coef``.
- Trainer/inference mismatch: the rollouts were sampled from ``q``, which is not ``pi_old``. The
  engine's sampler is not the trainer's forward, and with generation lag (``generation_lag > 0``)
  the rollouts come from weights up to that many updates older than ``pi_old``, so the ratio
  alone does not correct for them (the trainer turns ``is_mode`` on by default then). With the
  engine's logprobs ``log q``, ``is_mode="truncate"`` multiplies ``pg_t`` by the truncated
  importance weight ``w_t = min(exp(log pi_old - log q), is_cap)`` (TIS; Yao et al. 2025, "Your Efficient RL
  Framework
  Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl; Ionides 2008
  "Truncated importance sampling"). ``is_mode="mask"`` drops whole sequences whose geometric-mean
  weight ``exp(mean_t (log pi_old - log q))`` is outside ``[1 / is_cap, is_cap]`` (masked IS).

Two other surrogates take the place of ``pg_t`` where a caller asks for them (`cispo_surrogate`,
`dro_surrogate`; the Tinker API's ``cispo`` and ``dro`` losses)::

    cispo_t = -sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * log pi(y_t)     CISPO
    dro_t   = -(A * log pi(y_t) - beta / 2 * (log r)^2)                         DRO

- CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, eq. 4): the clipped ratio only weighs the
  REINFORCE gradient, so a clipped token still passes a gradient, unlike PPO's.
- DRO (Richemond et al. 2024, "Offline Regularised Reinforcement Learning for LLM Alignment",
  arXiv:2405.19107; Kimi Team 2025, "Kimi k1.5", arXiv:2501.12599, eq. 3): a quadratic penalty on
  the log-ratio in place of clipping. Here ``r = pi / pi_old`` with the old policy's logprobs given.

Aggregation (how the ``l_t`` become one number; ``m`` is the loss mask, ``n_i`` tokens of sequence
``i``, ``N`` the number of sequences with at least one token in the mask)::

    token_mean               sum_i sum_t l / sum_i n_i            DAPO token-level loss
    seq_mean_token_mean      sum_i (sum_t l / n_i) / N            GRPO (DeepSeekMath eq. 3)
    seq_mean_token_sum       sum_i sum_t l / N
    seq_mean_token_sum_norm  sum_i sum_t l / (N * max_length)     Dr. GRPO (constant length)

The denominator is the `normalizer`. Each of these counts adds up over micro-batches as long as a
sequence is never split between two, so passing the full batch's denominator (`loss_normalizer` of
the whole batch, or the sum of `loss_normalizer` over its micro-batches) to every micro-batch makes
the micro-batch losses sum to the full-batch loss, and their gradients to its gradient.

Inputs are ``[B, T]`` with one sequence per row, or packed rows (``[1, tokens]`` or ``[R, T]``)
holding several sequences: then ``sequence_ids`` gives each token's sequence index, and per-sequence
``advantages`` are indexed by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import get_args

import torch

from llmrl.config import Aggregation, AlgorithmConfig, ISMode, KLEstimator, RatioLevel

AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
IS_MODES: tuple[str, ...] = get_args(ISMode)

# Log-ratios are clamped to +-LOG_RATIO_LIMIT before exp(): e^20 ~ 5e8 is far outside any clip range,
# and one wild token must not turn the whole loss into inf/NaN.
LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True)
class LossOptions:
    """The settings of `policy_loss` (see the module docstring for their formulas), checked when made."""

    clip_low: float = 0.2
    """Ratio clip range ``[1 - clip_low, 1 + clip_high]``."""
    clip_high: float = 0.2
    dual_clip: float | None = None
    """Constant ``c > 1`` capping the loss of negative-advantage tokens at ``-c * A``; None: off."""
    ratio_level: RatioLevel = "token"
    """``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO)."""
    aggregation: Aggregation = "token_mean"
    max_length: int | None = None
    """The constant length of ``seq_mean_token_sum_norm``."""
    kl_beta: float = 0.0
    """Weight of the KL penalty; `policy_loss` then needs ``ref_logprobs``."""
    kl_estimator: KLEstimator = "k3"
    kl_ratio_weighted: bool = False
    """Multiply each token's KL by the ratio ``r`` (DeepSeek-V3.2's unbiased KL gradient)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus; `policy_loss` then needs ``entropies``."""
    is_mode: ISMode | None = None
    """``"truncate"`` (token IS weights capped at `is_cap`), ``"mask"`` (drop sequences whose
    geometric-mean IS weight is outside ``[1/is_cap, is_cap]``) or None; needs ``inference_logprobs``."""
    is_cap: float = 2.0
    """Cap (``truncate``) or threshold (``mask``) of the IS weights."""

    def __post_init__(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(
                f"clip_low and clip_high must be >= 0, got clip_low={self.clip_low}, clip_high={self.clip_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {self.ratio_level!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.aggregation == "seq_mean_token_sum_norm" and (self.max_length is None or self.max_length < 1):
            raise ValueError(
                "max_length (a positive int) is required for aggregation='seq_mean_token_sum_norm'"
            )
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.is_mode is not None and self.is_mode not in IS_MODES:
            raise ValueError(f"is_mode must be one of {IS_MODES} or None, got {self.is_mode!r}")
        if not self.is_cap > 0:
            raise ValueError(f"is_cap must be > 0, got {self.is_cap}")

    @classmethod
    def from_config(cls, algorithm: AlgorithmConfig, *, max_tokens: int, generation_lag: int) -> LossOptions:
        """The options of a run: `max_length` defaults to the generation's `max_tokens`, and `is_mode`
        ``auto`` truncates IS weights when rollouts are generated ahead of training (`generation_lag` > 0),
        since they then come from older weights than the ratio corrects for."""
        automatic = "truncate" if generation_lag > 0 else None
        derived = ("max_length", "is_mode")
        same_named = {f.name: getattr(algorithm, f.name) for f in fields(cls) if f.name not in derived}
        return cls(
            **same_named,
            max_length=algorithm.max_length or max_tokens,
            is_mode={"auto": automatic, "off": None}.get(algorithm.is_mode, algorithm.is_mode),
        )


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: LossOptions = LossOptions(),  # noqa: B008 (frozen, so one shared default is safe)
    *,
    normalizer: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    inference_logprobs: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy-gradient loss to minimise and its metrics (see the module docstring for formulas).

    Args:
        logprobs: ``[B, T]`` current policy logprobs of the sampled tokens (carry the gradient).
        old_logprobs: ``[B, T]`` logprobs under the policy that produced the advantages.
        advantages: ``[B]`` (one per row), ``[S]`` (one per sequence id, with `sequence_ids`), or
            ``[B, T]`` per token.
        mask: ``[B, T]`` True (or 1) on the completion tokens that the loss sees.
        options: the loss's settings (`LossOptions`).
        normalizer: denominator to use instead of this batch's own (see `loss_normalizer`).
        ref_logprobs: ``[B, T]`` reference-policy logprobs; needed when ``options.kl_beta > 0``.
        entropies: ``[B, T]`` full-distribution entropies; needed when ``options.entropy_coef > 0``.
        inference_logprobs: ``[B, T]`` logprobs the inference engine reported; needed for ``options.is_mode``.
            Given without it, they only feed the mismatch metrics.
        sequence_ids: ``[B, T]`` sequence index of each token for packed rows (non-negative on masked
            tokens; anything, e.g. -1, elsewhere). None means one sequence per row.

    Returns ``(loss, metrics)``: a scalar tensor and a dict of floats. Metrics are token means over
    the masked tokens of this call unless named otherwise; ``num_tokens`` / ``num_sequences`` let a
    caller weight them across micro-batches. The trainer builds the same loss from the same pieces
    (`TokenLoss`, `clipped_surrogate`, `add_kl_penalty`), one loss term of its own at a time.
    """
    _check_normalizer(normalizer)
    _check_shapes(logprobs, old_logprobs, mask, ref_logprobs, entropies, inference_logprobs, sequence_ids)
    if options.kl_beta > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs are required when kl_beta > 0")
    if options.entropy_coef > 0 and entropies is None:
        raise ValueError("entropies are required when entropy_coef > 0")
    if options.is_mode is not None and inference_logprobs is None:
        raise ValueError(f"inference_logprobs are required when is_mode={options.is_mode!r}")
    loss = TokenLoss(logprobs, mask, sequence_ids)
    surrogate = clipped_surrogate(loss, old_logprobs, advantages, options, inference_logprobs)
    if ref_logprobs is not None:
        add_kl_penalty(loss, ref_logprobs, options, surrogate.ratio)
    if entropies is not None:
        loss.add_weighted("entropy", entropies, -options.entropy_coef)
    total = loss.aggregate(options.aggregation, options.max_length, normalizer)
    loss.metrics.update(surrogate.statistics(loss))
    loss.metrics.update(loss.counts())
    return total, loss.metrics


class TokenLoss:
    """One batch's per-token loss ``l_t``, built a term at a time, and its aggregate.

    The terms add up in the order they are added (float addition is not associative, so the order is
    part of the result), and the aggregation weights them all alike: a sequence that masked IS drops
    (`keep`) leaves every term. Off the mask inputs may hold anything (padding, -inf): each term's
    inputs are zeroed there before any exp(), so garbage reaches neither the loss nor its gradient.
    """

    def __init__(self, logprobs: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor | None = None):
        self.in_mask = mask.bool()
        self.mask = self.in_mask.to(logprobs.dtype)  # (B, T) 1.0 on loss tokens
        self.segment, num_segments = _segment_index(self.in_mask, sequence_ids)
        self.tokens_per_sequence = _segment_sum(self.mask, self.segment, num_segments)  # (S,)
        self.sequence_ids = sequence_ids
        self.logprobs = torch.where(self.in_mask, logprobs, 0.0)
        self.keep = self.mask
        """(B, T) 1.0 on the tokens that stay in the loss (masked IS drops whole sequences)."""
        self.metrics: dict[str, float] = {}
        self.weight: torch.Tensor | None = None
        """The aggregation's per-token weight, once `aggregate` has run (the same for every term)."""
        self.normalizer = 1.0
        self._per_token: torch.Tensor | None = None

    def add(self, per_token: torch.Tensor) -> None:
        """Add a term's ``[B, T]`` per-token loss, already weighted."""
        self._per_token = per_token if self._per_token is None else self._per_token + per_token

    def add_weighted(self, name: str, values: torch.Tensor, coef: float) -> None:
        """Add ``coef * values`` (zero off the mask); their token mean is metric `name`."""
        values = torch.where(self.in_mask, values, 0.0)
        self.metrics[name] = self.token_mean(values)
        self.add(coef * values)

    def token_mean(self, values: torch.Tensor) -> float:
        return _token_mean(values, self.mask)

    def aggregate(
        self, aggregation: Aggregation, max_length: int | None, normalizer: float | None
    ) -> torch.Tensor:
        """The loss: the terms' sum, weighted by `aggregation` and divided by `normalizer` (None: this
        batch's own denominator)."""
        _check_normalizer(normalizer)
        assert self._per_token is not None, "no term was added"
        self.weight = self.keep * _aggregation_weight(self.segment, self.tokens_per_sequence, aggregation)
        if normalizer is None:
            # An empty mask has a zero numerator; dividing by 1 keeps the loss 0 and differentiable.
            normalizer = max(
                _denominator(self.mask.sum(), self.tokens_per_sequence, aggregation, max_length), 1.0
            )
        self.normalizer = normalizer
        loss = (self._per_token * self.weight).sum() / normalizer
        self.metrics["loss"] = loss.detach().item()
        return loss

    def counts(self) -> dict[str, float]:
        """The masked tokens and the sequences that have any, for weighting metrics across batches."""
        return {
            "num_tokens": float(self.mask.sum()),
            "num_sequences": float((self.tokens_per_sequence > 0).sum()),
        }


@dataclass(frozen=True)
class Surrogate:
    """The clipped surrogate of a `TokenLoss`, kept for its statistics once the loss is aggregated."""

    pg: torch.Tensor
    """(B, T) the surrogate's per-token loss, IS-weighted when `is_mode` is ``truncate``."""
    ratio: torch.Tensor
    """(B, T) the ratio ``r`` (GSPO's per-sequence one with ``ratio_level="sequence"``)."""
    token_log_ratio: torch.Tensor
    advantages: torch.Tensor
    options: LossOptions

    @torch.no_grad()
    def statistics(self, loss: TokenLoss) -> dict[str, float]:
        """Its share of the aggregated `loss` (``pg_loss``), the ratio's mean and clipped fractions, and
        ``approx_kl``: KL(pi_old || pi), sampled from pi_old."""
        assert loss.weight is not None, "aggregate the loss first"
        ratio, advantages, options, m = self.ratio, self.advantages, self.options, loss.mask
        metrics = {
            "pg_loss": float((self.pg * loss.weight).sum() / loss.normalizer),
            "ratio_mean": loss.token_mean(ratio),
            "clip_frac_low": loss.token_mean(
                ((advantages < 0) & (ratio < 1.0 - options.clip_low)).to(m.dtype)
            ),
            "clip_frac_high": loss.token_mean(
                ((advantages > 0) & (ratio > 1.0 + options.clip_high)).to(m.dtype)
            ),
        }
        if options.dual_clip is not None:
            metrics["dual_clip_frac"] = loss.token_mean(
                ((advantages < 0) & (ratio > options.dual_clip)).to(m.dtype)
            )
        metrics["approx_kl"] = loss.token_mean(_k3(self.token_log_ratio))
        return metrics


def clipped_surrogate(
    loss: TokenLoss,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    options: LossOptions,
    inference_logprobs: torch.Tensor | None = None,
) -> Surrogate:
    """Add the PPO clipped surrogate (dual-clipped, GSPO's sequence ratio, IS-corrected as `options`
    say) to `loss` as its first term; the IS metrics join its metrics."""
    segment = loss.segment
    old_logprobs, advantages = _sampled_terms(loss, old_logprobs, advantages)
    token_log_ratio = _clamped(loss.logprobs - old_logprobs)  # log pi / pi_old, (B, T)
    if options.ratio_level == "sequence":
        per_sequence = _segment_mean(token_log_ratio, segment, loss.tokens_per_sequence)  # (S,)
        log_ratio = per_sequence[segment].detach() + loss.logprobs - loss.logprobs.detach()  # GSPO-token form
    else:
        log_ratio = token_log_ratio
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1.0 - options.clip_low, 1.0 + options.clip_high)
    pg = -torch.minimum(ratio * advantages, clipped_ratio * advantages)  # (B, T)
    if options.dual_clip is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -options.dual_clip * advantages), pg)
    if inference_logprobs is not None:
        pg = _importance_sampling(loss, pg, old_logprobs, inference_logprobs, options)
    loss.add(pg)
    return Surrogate(pg, ratio, token_log_ratio, advantages, options)


def cispo_surrogate(
    loss: TokenLoss, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> None:
    """Add CISPO's per-token loss (module docstring) to `loss`; ``ratio_mean`` and the clipped fractions
    join its metrics."""
    old_logprobs, advantages = _sampled_terms(loss, old_logprobs, advantages)
    ratio = _clamped(loss.logprobs - old_logprobs).exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    loss.add(-weight * advantages * loss.logprobs)
    loss.metrics.update(
        ratio_mean=loss.token_mean(ratio),
        clip_frac_low=loss.token_mean((ratio < 1.0 - clip_low).to(loss.mask.dtype)),
        clip_frac_high=loss.token_mean((ratio > 1.0 + clip_high).to(loss.mask.dtype)),
    )


def dro_surrogate(loss: TokenLoss, old_logprobs: torch.Tensor, advantages: torch.Tensor, beta: float) -> None:
    """Add DRO's per-token loss (module docstring) to `loss`; the penalty's token mean is
    ``dro_penalty``."""
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    old_logprobs, advantages = _sampled_terms(loss, old_logprobs, advantages)
    penalty = 0.5 * beta * (loss.logprobs - old_logprobs) ** 2
    loss.metrics["dro_penalty"] = loss.token_mean(penalty)
    loss.add(-(advantages * loss.logprobs - penalty))


def _sampled_terms(
    loss: TokenLoss, old_logprobs: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling policy's logprobs (a constant of the objective) and per-token advantages, zero off
    the mask."""
    in_mask = loss.in_mask
    old_logprobs = torch.where(in_mask, old_logprobs.detach(), 0.0)
    advantages = _per_token_advantages(advantages, in_mask, loss.segment, loss.sequence_ids)
    return old_logprobs, torch.where(in_mask, advantages, 0.0)


def _importance_sampling(
    loss: TokenLoss,
    pg: torch.Tensor,
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    options: LossOptions,
) -> torch.Tensor:
    """`pg` corrected for the trainer/inference mismatch by `options.is_mode` (masked IS drops sequences
    from `loss.keep` instead); the mismatch metrics join the loss's."""
    in_mask, m, metrics = loss.in_mask, loss.mask, loss.metrics
    inference_logprobs = torch.where(in_mask, inference_logprobs.detach(), 0.0)
    is_log_weight = _clamped(old_logprobs - inference_logprobs)  # log pi_old / q, (B, T)
    is_weight = is_log_weight.exp()
    metrics["mismatch_kl"] = _token_mean(_k3(is_log_weight), m)  # KL(q || pi_old), sampled from q
    metrics["is_weight_mean"] = _token_mean(is_weight, m)
    metrics["is_weight_max"] = float(is_weight[in_mask].max()) if in_mask.any() else 0.0
    if options.is_mode == "truncate":
        pg = pg * is_weight.clamp(max=options.is_cap)  # a constant weight: both logprobs are detached
        metrics["is_truncated_frac"] = _token_mean((is_weight > options.is_cap).to(m.dtype), m)
    elif options.is_mode == "mask":
        seq_log_weight = _segment_mean(is_log_weight, loss.segment, loss.tokens_per_sequence)  # (S,)
        outside = seq_log_weight.abs() > math.log(options.is_cap)  # (S,) weight outside [1/is_cap, is_cap]
        loss.keep = m * (~outside[loss.segment]).to(m.dtype)
        has_tokens = loss.tokens_per_sequence > 0
        metrics["is_masked_seq_frac"] = float((outside & has_tokens).sum() / has_tokens.sum().clamp(min=1))
    return pg


def add_kl_penalty(
    loss: TokenLoss, ref_logprobs: torch.Tensor, options: LossOptions, ratio: torch.Tensor
) -> None:
    """Add ``kl_beta`` times the KL to the reference (times the surrogate's `ratio` with
    ``kl_ratio_weighted``) to `loss`; its token mean is ``ref_kl``."""
    kl = kl_penalty(
        loss.logprobs, torch.where(loss.in_mask, ref_logprobs.detach(), 0.0), options.kl_estimator
    )
    loss.metrics["ref_kl"] = loss.token_mean(kl)
    if options.kl_ratio_weighted:
        kl = kl * ratio  # r's value is 1 on-policy, but its gradient adds KL_t * grad log pi
    loss.add(options.kl_beta * kl)


def loss_normalizer(
    mask: torch.Tensor,
    aggregation: Aggregation = "token_mean",
    *,
    max_length: int | None = None,
    sequence_ids: torch.Tensor | None = None,
) -> float:
    """The denominator `policy_loss` divides by for this mask (see the module docstring).

    Compute it over the *whole* batch (or sum it over the micro-batches: tokens and non-empty
    sequences add up, provided no sequence is split between micro-batches) and pass it as
    ``normalizer`` to each micro-batch's `policy_loss`; the micro-batch losses then sum to the
    full-batch loss.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "seq_mean_token_sum_norm" and (max_length is None or max_length < 1):
        raise ValueError("max_length (a positive int) is required for aggregation='seq_mean_token_sum_norm'")
    if sequence_ids is not None and sequence_ids.shape != mask.shape:
        raise ValueError(f"sequence_ids has shape {tuple(sequence_ids.shape)}, mask has {tuple(mask.shape)}")
    in_mask = mask.bool()
    segment, num_segments = _segment_index(in_mask, sequence_ids)
    tokens_per_sequence = _segment_sum(in_mask.to(torch.float32), segment, num_segments)
    return float(_denominator(in_mask.sum(), tokens_per_sequence, aggregation, max_length))


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs (k1, k2 or k3)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs has shape {tuple(ref_logprobs.shape)}, logprobs has {tuple(logprobs.shape)}"
        )
    log_rho = _clamped(ref_logprobs - logprobs)  # log pi_ref / pi
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho**2
    return _k3(log_rho)


# ---------------------------------------------------------------------------------------------
# Helpers


def _check_normalizer(normalizer: float | None) -> None:
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0 (or None), got {normalizer}")


def _k3(log_rho: torch.Tensor) -> torch.Tensor:
    return log_rho.exp() - 1.0 - log_rho


def _clamped(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _token_mean(values: torch.Tensor, m: torch.Tensor) -> float:
    with torch.no_grad():
        count = m.sum()
        return float(torch.where(m > 0, values, 0.0).sum() / count) if count > 0 else 0.0


def _segment_index(in_mask: torch.Tensor, sequence_ids: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Per-token sequence index ``[B, T]`` (valid on masked tokens, 0 elsewhere) and the index range."""
    rows, _ = in_mask.shape
    if sequence_ids is None:
        return torch.arange(rows, device=in_mask.device)[:, None].expand_as(in_mask), rows
    ids = sequence_ids.long()
    masked_ids = ids[in_mask]
    if masked_ids.numel() and masked_ids.min() < 0:
        raise ValueError("sequence_ids must be >= 0 on every masked token")
    segment = torch.where(in_mask, ids, 0)
    return segment, int(masked_ids.max()) + 1 if masked_ids.numel() else 1


def _segment_sum(values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sum of `values` ``[B, T]`` per segment id -> ``[num_segments]`` (differentiable)."""
    out = torch.zeros(num_segments, dtype=values.dtype, device=values.device)
    return out.index_add(0, segment.reshape(-1), values.reshape(-1))


def _segment_mean(
    values: torch.Tensor, segment: torch.Tensor, tokens_per_sequence: torch.Tensor
) -> torch.Tensor:
    """Mean of `values` (already zero off the mask) per segment; 0 for empty segments."""
    sums = _segment_sum(values, segment, tokens_per_sequence.shape[0])
    return sums / tokens_per_sequence.clamp(min=1)


def _per_token_advantages(
    advantages: torch.Tensor, in_mask: torch.Tensor, segment: torch.Tensor, sequence_ids: torch.Tensor | None
) -> torch.Tensor:
    if advantages.shape == in_mask.shape:
        return advantages
    if advantages.dim() == 1:
        if sequence_ids is None:
            if advantages.shape[0] != in_mask.shape[0]:
                raise ValueError(
                    f"advantages has {advantages.shape[0]} entries but the batch has {in_mask.shape[0]} rows"
                )
            return advantages[:, None].expand_as(in_mask)
        needed = int(segment[in_mask].max()) + 1 if in_mask.any() else 0
        if advantages.shape[0] < needed:
            raise ValueError(
                f"advantages has {advantages.shape[0]} entries but sequence_ids go up to {needed - 1}"
            )
        return advantages[segment]
    raise ValueError(
        f"advantages must be [B], [num_sequences] or [B, T] like mask {tuple(in_mask.shape)}, "
        f"got {tuple(advantages.shape)}"
    )


def _aggregation_weight(
    segment: torch.Tensor, tokens_per_sequence: torch.Tensor, aggregation: str
) -> torch.Tensor:
    """Per-token weight in the numerator: 1/n_i for seq_mean_token_mean, 1 otherwise."""
    if aggregation == "seq_mean_token_mean":
        return 1.0 / tokens_per_sequence.clamp(min=1)[segment]
    return torch.ones_like(tokens_per_sequence)[segment]


def _denominator(
    num_tokens: torch.Tensor, tokens_per_sequence: torch.Tensor, aggregation: str, max_length: int | None
) -> float:
    if aggregation == "token_mean":
        return float(num_tokens)
    num_sequences = float((tokens_per_sequence > 0).sum())
    if aggregation == "seq_mean_token_sum_norm":
        assert max_length is not None  # checked by the callers
        return num_sequences * max_length
    return num_sequences


def _check_shapes(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    entropies: torch.Tensor | None,
    inference_logprobs: torch.Tensor | None,
    sequence_ids: torch.Tensor | None,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    named = {
        "old_logprobs": old_logprobs,
        "mask": mask,
        "ref_logprobs": ref_logprobs,
        "entropies": entropies,
        "inference_logprobs": inference_logprobs,
        "sequence_ids": sequence_ids,
    }
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs has {tuple(logprobs.shape)}")
