"""The contract of a loss term, and what the update hands its terms: the step, then each micro-batch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property

import torch

from llmrl.algorithms.losses import Surrogate, TokenLoss
from llmrl.algorithms.packing import PackedBatch
from llmrl.rollouts import RolloutBatch
from llmrl.trainer.passes import ForwardPasses, PolicyTokens
from llmrl.types import GenerationArgs


@dataclass
class Step:
    """One step's batch and what its terms prepared for the optimizer steps."""

    batch: RolloutBatch
    sampling_args: list[GenerationArgs]
    """Each rollout's sampling options (the run's `generation_args` unless it had its own)."""
    trained: list[int]
    """The rollouts the passes run on: those that can change the loss (see `LossTerm.trains_zero_advantage`)."""
    advantages: torch.Tensor
    """Each rollout's advantage, on the policy's device: its reward advantage, unless a term replaced it."""
    old_logprobs: list[torch.Tensor | None] | None = None
    """``pi_old``'s per-token logprobs of each trained rollout, from a pass before the first update; None
    when ``pi_old`` is the policy being trained (one pass, one mini-batch, no term needing them)."""
    token_advantages: list[torch.Tensor] | None = None
    """Per-token advantages of each rollout that a term adds to its advantage; None: none."""

    @cached_property
    def sequences(self) -> list[list[int]]:
        return self.batch.sequences

    @cached_property
    def masks(self) -> list[list[bool]]:
        return self.batch.loss_masks


@dataclass
class MicroBatch:
    """One micro-batch of an optimizer step, as its terms see it while they build its loss."""

    step: Step
    packed: PackedBatch
    policy: PolicyTokens
    loss: TokenLoss
    surrogate: Surrogate | None = field(default=None)
    """The clipped surrogate, once the policy-gradient term (always the first) has added it."""


class LossTerm(ABC):
    """One signal of the policy update: what it computes before the step's optimizer steps
    (`prepare`), and what it adds to each micro-batch's loss (`add_loss`) and metrics."""

    trains_zero_advantage = False
    """Whether a rollout whose advantage is 0 still gets a gradient from this term. When no term's
    does, such rollouts skip their passes (whole GRPO groups with equal rewards are common): they
    contribute nothing but their share of the denominator."""
    needs_old_logprobs = False
    """Whether `prepare` needs ``pi_old``'s logprobs even when they are the trained policy's own."""

    def __init__(self, passes: ForwardPasses):
        self.passes = passes

    def prepare(self, step: Step) -> dict[str, float]:
        """The no-grad passes and per-step values the optimizer steps need; returns the step's metrics
        of this term. May replace `step.advantages` or set `step.token_advantages`."""
        return {}

    @abstractmethod
    def add_loss(self, micro: MicroBatch) -> None:
        """Add this term's per-token loss to `micro.loss` (and its metrics to `micro.loss.metrics`)."""

    def statistics(self, micro: MicroBatch) -> dict[str, float]:
        """Metrics of `micro` that need its aggregated loss (its weights and denominator)."""
        return {}
