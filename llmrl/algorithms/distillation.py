"""On-policy distillation's per-token signals: how far the policy's next-token distribution is from a
teacher's, at the positions the policy itself sampled.

The policy samples ``y ~ pi``; the teacher scores every position of it. Two signals, one per
`distillation.signal`:

``sampled`` (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", arXiv:2306.13649; Lu and Thinking Machines Lab 2025, "On-Policy
Distillation"): per completion token ``t`` the advantage ::

    A_t = coef * (log pi_teacher(y_t) - log pi(y_t))

minus the one-sample estimate of the reverse KL ``KL(pi || pi_teacher)`` at that token, so a policy
gradient with it lowers the reverse KL. One sample per position: unbiased, but noisy where the
teacher is confident (a token it finds unlikely gives a large negative advantage).

``top_k`` (the top-k logit distillation of NeMo-RL, with a remainder bucket): the exact reverse KL
at each position over the teacher's ``k`` likeliest tokens plus "the rest of the vocabulary" as one
more outcome ::

    KL_t = sum_{j in top-k, rest} P_j (log P_j - log Q_j)

with ``P`` the policy's and ``Q`` the teacher's probabilities of those ``k + 1`` outcomes (both of the
same tempered distribution the token was sampled from). Merging outcomes never raises a KL, so this
is a lower bound of the full reverse KL that equals it once the teacher's mass lies in its top k. It
is a loss term of its own with its exact gradient: no sampling noise at any position.
"""

from __future__ import annotations

import torch

LOGPROB_FLOOR = -100.0
"""Logprobs are clamped here before differences are taken: a teacher's empty remainder (``k`` at
least the vocabulary) is ``-inf``, and ``0 * (-inf - -inf)`` would be NaN."""


def distillation_advantages(
    teacher_logprobs: torch.Tensor, policy_logprobs: torch.Tensor, mask: torch.Tensor, coef: float = 1.0
) -> torch.Tensor:
    """``coef * (teacher - policy)`` on the tokens of `mask`, 0 elsewhere (whatever the inputs hold there).

    All three are alike in shape (``[B, T]``, packed rows, or one sequence's ``[T]``); the logprobs are
    of the sampled tokens, the policy's those of the weights that are trained from (constants here).
    """
    if not teacher_logprobs.shape == policy_logprobs.shape == mask.shape:
        raise ValueError(
            f"teacher_logprobs {tuple(teacher_logprobs.shape)}, policy_logprobs {tuple(policy_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have one shape"
        )
    in_mask = mask.bool()
    gap = torch.where(in_mask, teacher_logprobs.detach(), 0.0) - torch.where(
        in_mask, policy_logprobs.detach(), 0.0
    )
    return coef * gap


def reverse_kl_sums(
    teacher_logprobs: torch.Tensor, policy_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[float, float]:
    """The sum over the tokens of `mask` of ``policy - teacher`` (the reverse-KL estimate) and their count."""
    gap = -distillation_advantages(teacher_logprobs, policy_logprobs, mask)
    return float(gap.sum()), float(mask.bool().sum())


def grouped_logprobs(log_probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[n, k + 1]``: the logprobs of the tokens `ids` (``[n, k]``, distinct per row) in ``[n, V]``
    `log_probs`, then that of every other token together (``-inf`` when there is none)."""
    rest = log_probs.scatter(-1, ids, -torch.inf).logsumexp(dim=-1, keepdim=True)
    return torch.cat([log_probs.gather(-1, ids), rest], dim=-1)


def teacher_top_k(log_probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher's ``[n, V]`` logprobs cut to its `k` likeliest tokens (at most the vocabulary):
    their `grouped_logprobs` ``[n, k + 1]`` and their ids ``[n, k]``."""
    ids = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1).indices
    return grouped_logprobs(log_probs, ids), ids


def top_k_reverse_kl(
    policy_log_probs: torch.Tensor, teacher_logprobs: torch.Tensor, teacher_ids: torch.Tensor
) -> torch.Tensor:
    """``[n]`` reverse KL from the policy to the teacher over the teacher's top-k outcomes and the rest.

    `policy_log_probs` ``[n, V]`` carries the gradient; `teacher_logprobs` ``[n, k + 1]`` and
    `teacher_ids` ``[n, k]`` are `teacher_top_k`'s. The value is ``KL_t``; the gradient is written
    ``sum_j P_j (log P_j - log Q_j) grad log P_j``, equal to ``grad KL_t`` (the dropped term is
    ``sum_j P_j grad log P_j = grad sum_j P_j = 0``), so that a policy equal to its teacher gets a
    gradient of exactly 0 rather than float noise.
    """
    if teacher_logprobs.shape[-1] != teacher_ids.shape[-1] + 1:
        raise ValueError(
            f"teacher_logprobs {tuple(teacher_logprobs.shape)} needs one more column than teacher_ids "
            f"{tuple(teacher_ids.shape)} (the rest of the vocabulary)"
        )
    policy = grouped_logprobs(policy_log_probs, teacher_ids).clamp(min=LOGPROB_FLOOR)
    teacher = teacher_logprobs.detach().clamp(min=LOGPROB_FLOOR)
    weights = (policy.exp() * (policy - teacher)).detach()  # [n, k + 1]
    return weights.sum(-1) + (weights * (policy - policy.detach())).sum(-1)
