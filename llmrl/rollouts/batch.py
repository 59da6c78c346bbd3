"""From a step's rollout groups to what the optimiser trains on.

`prepare_batch` applies the reward shaping (DAPO soft overlong punishment), computes the group
advantages and picks the rollouts that reach the loss:

- placeholders (failed rollouts) never do; they are also left out of their group's statistics;
- an episode of several token sequences (`TokenRollout.extra_sequences`) brings each of them, with
  the episode's advantage;
- with `mask_truncated`, completions cut off by max_tokens keep their place in the statistics
  but get no gradient (DAPO overlong filtering);
- the loss denominator counts every rollout that reaches the loss (see `RolloutBatch.normalizer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from llmrl.algorithms.advantages import group_advantages
from llmrl.algorithms.losses import loss_normalizer
from llmrl.algorithms.shaping import soft_overlong_penalty
from llmrl.config import AlgorithmConfig
from llmrl.types import RolloutGroup, TokenRollout


@dataclass
class RolloutBatch:
    """The rollouts of one step that reach the loss, with one advantage each."""

    rollouts: list[TokenRollout]
    advantages: torch.Tensor
    """``[len(rollouts)]`` float32."""

    def __len__(self) -> int:
        return len(self.rollouts)

    @property
    def sequences(self) -> list[list[int]]:
        return [r.tokens for r in self.rollouts]

    @property
    def loss_masks(self) -> list[list[bool]]:
        return [r.mask for r in self.rollouts]

    @property
    def inference_logprobs(self) -> list[list[float]] | None:
        """Per token (0 off the generated tokens); None unless every rollout carries them."""
        if any(r.logprobs is None for r in self.rollouts):
            return None
        return [r.flat_logprobs for r in self.rollouts]

    def normalizer(self, indices: Sequence[int], aggregation: str, max_length: int) -> float:
        """Loss denominator of the rollouts at `indices` (`llmrl.algorithms.losses.loss_normalizer`)."""
        if not indices:
            return 0.0
        masks = pad_sequence([torch.tensor(self.rollouts[i].mask) for i in indices], batch_first=True)
        return loss_normalizer(masks, aggregation, max_length=max_length)  # type: ignore[arg-type]


def prepare_batch(
    groups: Sequence[RolloutGroup], *, group_size: int, algorithm: AlgorithmConfig, max_tokens: int
) -> tuple[RolloutBatch, torch.Tensor]:
    """The step's loss rollouts and the advantage of every rollout (in group order)."""
    for group in groups:
        if len(group.rollouts) != group_size:
            raise ValueError(
                f"group {group.group_id} has {len(group.rollouts)} rollouts, expected {group_size}"
            )
    rollouts = [r for group in groups for r in group.rollouts]
    valid = torch.tensor([r.is_valid for r in rollouts], dtype=torch.bool)
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    if algorithm.overlong_buffer is not None:
        lengths = [r.num_generated for r in rollouts]
        buffer = min(algorithm.overlong_buffer, max_tokens)
        penalty = soft_overlong_penalty(lengths, max_tokens, buffer, algorithm.overlong_penalty)
        rewards = rewards + torch.where(valid, penalty, 0.0)
    advantages = group_advantages(
        rewards,
        group_size,
        algorithm.advantage_estimator,
        valid,
        batch_std_normalize=algorithm.batch_std_normalize,
        std_scope=algorithm.advantage_std_scope,
        ddof=algorithm.advantage_std_ddof,
        eps=algorithm.advantage_eps,
    )
    # An episode of several token sequences (an agent program's calls) trains each of them with the
    # episode's advantage.
    in_loss = [
        (i, sequence)
        for i, r in enumerate(rollouts)
        if valid[i]
        for sequence in r.sequences
        if sequence.num_generated > 0 and not (algorithm.mask_truncated and sequence.truncated)
    ]
    loss_advantages = advantages[[i for i, _ in in_loss]]
    return RolloutBatch([sequence for _, sequence in in_loss], loss_advantages), advantages
