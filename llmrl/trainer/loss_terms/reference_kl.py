"""The KL penalty to a frozen reference policy (`algorithm.kl_beta`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from llmrl.algorithms.losses import LossOptions, add_kl_penalty
from llmrl.algorithms.packing import pack_values
from llmrl.trainer.loss_terms.base import LossTerm, MicroBatch, Step
from llmrl.trainer.passes import ForwardPasses, Model


class ReferenceKL(LossTerm):
    """``kl_beta`` times the KL from the policy to the reference, whose logprobs come from one no-grad
    pass per step: of the reference model, or, with LoRA, of the policy inside `context` (its adapters
    off)."""

    def __init__(
        self,
        passes: ForwardPasses,
        options: LossOptions,
        model: Model,
        context: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ):
        super().__init__(passes)
        self.options = options
        self.model = model
        self.context = context
        self.trains_zero_advantage = options.kl_beta > 0
        self._logprobs: list[torch.Tensor | None] = []

    def prepare(self, step: Step) -> dict[str, float]:
        with self.context():
            self._logprobs = self.passes.sequence_logprobs(
                self.model, step.sequences, step.masks, step.trained
            )
        return {}

    def add_loss(self, micro: MicroBatch) -> None:
        assert micro.surrogate is not None, "the policy-gradient term comes first"
        reference = pack_values(self._logprobs, micro.packed)
        add_kl_penalty(micro.loss, reference, self.options, micro.surrogate.ratio)
