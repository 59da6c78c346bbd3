"""The metrics of a step's rollouts: rewards, pass rates, lengths, failures, and the age of their tokens."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence

import torch

from llmrl.types import RolloutGroup, TokenRollout


def rollout_metrics(
    groups: Sequence[RolloutGroup], advantages: torch.Tensor, *, correct_threshold: float
) -> dict[str, float]:
    """Reward, pass rate, length and failure statistics of a step's rollouts, overall and per env."""
    rollouts = [r for group in groups for r in group.rollouts]
    valid = [r for r in rollouts if r.is_valid]
    metrics: dict[str, float] = {}
    by_env: dict[str, list[TokenRollout]] = defaultdict(list)
    for rollout in valid:
        by_env[rollout.env_id].append(rollout)
    for prefix, members in [("reward", valid)] + [
        (f"reward/{env}", rs) for env, rs in sorted(by_env.items())
    ]:
        rewards = torch.tensor([r.reward for r in members], dtype=torch.float64)
        metrics[f"{prefix}/mean"] = float(rewards.mean()) if members else math.nan
        metrics[f"{prefix}/std"] = float(rewards.std(unbiased=False)) if members else math.nan
        metrics[f"{prefix}/pass_rate"] = (
            float((rewards >= correct_threshold).double().mean()) if members else math.nan
        )
    for env, members in sorted(by_env.items()):  # each reward function's mean, where it applied
        components: dict[str, list[float]] = defaultdict(list)
        for rollout in members:
            for name, value in rollout.reward_components.items():
                components[name].append(value)
        metrics |= {
            f"reward/{env}/{name}": sum(values) / len(values) for name, values in sorted(components.items())
        }
    lengths = torch.tensor([r.num_generated for r in valid], dtype=torch.float64)
    metrics["rollout/response_length"] = float(lengths.mean()) if valid else math.nan
    metrics["rollout/response_length_max"] = float(lengths.max()) if valid else math.nan
    metrics["rollout/truncated_frac"] = sum(r.truncated for r in valid) / len(valid) if valid else math.nan
    metrics["rollout/placeholder_frac"] = 1.0 - len(valid) / len(rollouts) if rollouts else 0.0
    if groups:
        has_signal = advantages.view(len(groups), -1).ne(0).any(dim=1)
        metrics["rollout/zero_signal_group_frac"] = 1.0 - float(has_signal.float().mean())
    metrics["rollout/advantage_abs_mean"] = float(advantages.abs().mean()) if advantages.numel() else 0.0
    return metrics


def staleness_metrics(groups: Sequence[RolloutGroup], trained_version: int) -> dict[str, float]:
    """How many weight versions behind the trained policy the step's sampled tokens were generated:
    mean and max over the tokens, and the share of tokens of each age (``rollout/token_age/K``)."""
    ages: Counter[int] = Counter()
    for rollout in (r for g in groups for r in g.rollouts if r.is_valid):
        for sequence in rollout.sequences:
            sampled = zip(sequence.token_versions, sequence.mask, strict=True)
            ages.update(trained_version - version for version, generated in sampled if generated)
    total = sum(ages.values())
    if not total:
        return {}
    metrics = {
        "rollout/staleness_mean": sum(age * count for age, count in ages.items()) / total,
        "rollout/staleness_max": float(max(ages)),
    }
    return metrics | {
        f"rollout/token_age/{age}": ages[age] / total for age in range(min(ages), max(ages) + 1)
    }
