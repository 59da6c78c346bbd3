"""The entropy bonus (`algorithm.entropy_coef`), and the `entropy` metric of every run."""

from __future__ import annotations

from llmrl.trainer.loss_terms.base import LossTerm, MicroBatch
from llmrl.trainer.passes import ForwardPasses


class EntropyBonus(LossTerm):
    """Minus `coef` times the entropy of the policy's next-token distribution at each token. With
    `coef` 0 the entropy is a metric only, with no backward pass through it."""

    def __init__(self, passes: ForwardPasses, coef: float):
        super().__init__(passes)
        self.coef = coef
        self.trains_zero_advantage = coef > 0

    def add_loss(self, micro: MicroBatch) -> None:
        entropies = micro.policy.entropies if self.coef > 0 else micro.policy.entropies.detach()
        micro.loss.add_weighted("entropy", entropies, -self.coef)
