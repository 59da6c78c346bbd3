"""On-policy distillation's per-token signal: the teacher's logprob of each sampled token against the policy's.

The policy samples ``y ~ pi``; the teacher scores every sampled token. Per completion token ``t``::

    A_t = coef * (log pi_teacher(y_t) - log pi(y_t))

is minus the single-sample estimate of the reverse KL ``KL(pi || pi_teacher)`` at that token, so a
policy gradient with ``A_t`` as its advantage lowers the reverse KL (Agarwal et al. 2024, "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes", arXiv:2306.13649; Lu and
Thinking Machines Lab 2025, "On-Policy Distillation"). Each token gets its own signal: a wrong step
is penalised where it happens, not through the outcome of the whole sequence.
"""

from __future__ import annotations

import torch


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
