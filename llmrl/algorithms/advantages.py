"""Group-relative advantages: one scalar per rollout from the rewards of its prompt group.

Rewards arrive flat, ``[num_groups * group_size]``, groups contiguous (rollouts ``g*G .. g*G+G-1``
answer prompt ``g``). For rollout ``i`` of a group with valid rewards ``r_1..r_n``:

- ``grpo`` (GRPO, Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, eq. 3 outcome supervision):
  ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the *population* std (divide by n), as in the
  paper's group statistics.
- ``dr_grpo`` (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783):
  ``A_i = r_i - mean(r)``. Dividing by the std up-weights groups that are nearly all right or all
  wrong (question-difficulty bias); Dr. GRPO drops it.
- ``rloo`` (REINFORCE Leave-One-Out, Kool et al. 2019 "Buy 4 REINFORCE samples, get a baseline for
  free!"; Ahmadian et al. 2024, arXiv:2402.14740): ``A_i = r_i - mean_{j != i}(r_j)``
  ``= n / (n - 1) * (r_i - mean(r))``. The baseline does not depend on ``r_i``, so the estimate is
  unbiased.

``std_scope="batch"`` keeps each group's mean as the baseline of ``grpo`` but divides by the std of
every valid reward of the batch instead of the group's (group mean, batch std: "Lite PPO", Liu et al.
2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning", arXiv:2508.08221; TRL's
``scale_rewards="batch"``). ``batch_std_normalize`` (REINFORCE++, Hu 2025, arXiv:2501.03262) then
divides every advantage by the std of the advantages over the whole batch, which keeps the update
scale steady when rewards are sparse, without the per-group std's difficulty bias.

Every std divides ``sum (x - mean)^2`` by ``n - ddof`` (``ddof=0``: the population std of the GRPO
paper; ``ddof=1``: the sample std that TRL uses, with ``eps=1e-4``) and has `eps` added before it
divides.

Invalid rollouts (``valid`` False: placeholders or failed environments) take no part in any mean or
std and get advantage 0, so they add nothing to the policy gradient. A group whose valid rewards are
all equal carries no learning signal and gets exactly 0 (never NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import torch

from llmrl.config import AdvantageEstimator, StdScope

ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
STD_SCOPES: tuple[str, ...] = get_args(StdScope)


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_size: int,
    estimator: AdvantageEstimator = "grpo",
    valid: torch.Tensor | Sequence[bool] | None = None,
    *,
    batch_std_normalize: bool = False,
    std_scope: StdScope = "group",
    ddof: int = 0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages ``[N]`` for rewards ``[N]`` laid out as consecutive groups of `group_size`.

    Args:
        rewards: one reward per rollout, ``N = num_groups * group_size``.
        group_size: rollouts per prompt.
        estimator: ``"grpo"``, ``"dr_grpo"`` or ``"rloo"`` (see the module docstring).
        valid: optional bool per rollout; False rollouts are left out of the statistics and get 0.
        batch_std_normalize: divide by the std of all valid advantages in the batch (REINFORCE++).
        std_scope: the rewards whose std divides ``grpo`` advantages: ``"group"`` or ``"batch"``.
        ddof: subtracted from the count in every std (0: population std, 1: sample std).
        eps: added to every std before dividing.

    Returns a floating tensor shaped like `rewards` (float32 unless `rewards` is a floating tensor).
    """
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_groups * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if std_scope not in STD_SCOPES:
        raise ValueError(f"std_scope must be one of {STD_SCOPES}, got {std_scope!r}")
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 or 1, got {ddof}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    else:
        valid = torch.as_tensor(valid, dtype=torch.bool, device=rewards.device)
        if valid.shape != rewards.shape:
            raise ValueError(f"valid has shape {tuple(valid.shape)}, rewards has {tuple(rewards.shape)}")

    r = rewards.view(-1, group_size)  # (num_groups, G)
    v = valid.view(-1, group_size).to(rewards.dtype)  # (num_groups, G), 1.0 where valid
    count = v.sum(dim=1, keepdim=True)  # (num_groups, 1)
    mean = (r * v).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = (r - mean) * v
    if estimator == "grpo":
        if std_scope == "group":
            std = ((centered**2).sum(dim=1, keepdim=True) / (count - ddof).clamp(min=1)).sqrt()
        else:
            std = _std(rewards[valid], ddof)
        advantages = centered / (std + eps)
    elif estimator == "dr_grpo":
        advantages = centered
    else:  # rloo: r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean); a lone rollout has no baseline.
        advantages = torch.where(
            count > 1, centered * count / (count - 1).clamp(min=1), torch.zeros_like(centered)
        )

    # Equal rewards in a group: `centered` is only rounding noise (mean of 0.1s is not exactly 0.1),
    # and the std division would blow that noise up; such groups carry no signal, so write exact zeros.
    big = torch.finfo(rewards.dtype).max
    highest = torch.where(v > 0, r, torch.full_like(r, -big)).amax(dim=1, keepdim=True)
    lowest = torch.where(v > 0, r, torch.full_like(r, big)).amin(dim=1, keepdim=True)
    advantages = torch.where(highest > lowest, advantages, torch.zeros_like(advantages)).reshape(-1)

    if batch_std_normalize:
        valid_advantages = advantages[valid]
        if valid_advantages.numel() > 1:
            advantages = advantages / (_std(valid_advantages, ddof) + eps)
    return advantages


def _std(values: torch.Tensor, ddof: int) -> torch.Tensor:
    """The std of a 1-D tensor with ``n - ddof`` as divisor (0 for fewer than two values)."""
    if values.numel() < 2:
        return values.new_zeros(())
    return values.std(correction=ddof)
