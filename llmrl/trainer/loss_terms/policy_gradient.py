"""The GRPO family's policy-gradient term: the clipped surrogate, importance-sampling corrected."""

from __future__ import annotations

from llmrl.algorithms.losses import LossOptions, clipped_surrogate
from llmrl.algorithms.packing import pack_values
from llmrl.trainer.loss_terms.base import LossTerm, MicroBatch, Step
from llmrl.trainer.passes import ForwardPasses


class PolicyGradient(LossTerm):
    """`llmrl.algorithms.losses.clipped_surrogate` of each micro-batch, against ``pi_old`` and, for the
    trainer/inference mismatch, the engine's logprobs. Always a run's first term."""

    def __init__(self, passes: ForwardPasses, options: LossOptions):
        super().__init__(passes)
        self.options = options
        self._inference: list[list[float]] | None = None

    def prepare(self, step: Step) -> dict[str, float]:
        self._inference = step.batch.inference_logprobs
        return {}

    def add_loss(self, micro: MicroBatch) -> None:
        step, packed = micro.step, micro.packed
        advantages = step.advantages
        if step.token_advantages is not None:  # padding (-1) takes sequence 0's: off the mask, never scored
            advantages = advantages[packed.sequence_ids.clamp(min=0)] + pack_values(
                step.token_advantages, packed
            )
        # With one pass and one mini-batch pi_old is the policy being trained: the ratio is exactly 1.
        old = (
            micro.policy.logprobs.detach()
            if step.old_logprobs is None
            else pack_values(step.old_logprobs, packed)
        )
        inference = None if self._inference is None else pack_values(self._inference, packed)
        micro.surrogate = clipped_surrogate(micro.loss, old, advantages, self.options, inference)

    def statistics(self, micro: MicroBatch) -> dict[str, float]:
        assert micro.surrogate is not None
        return micro.surrogate.statistics(micro.loss)
