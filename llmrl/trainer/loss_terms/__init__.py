"""The loss terms of the policy update, one signal each (docs/development.md, "Adding a signal").

A term computes what it needs before the step's optimizer steps (`LossTerm.prepare`: no-grad passes
of a frozen model, per-step advantages) and adds its per-token loss and metrics to each micro-batch
(`LossTerm.add_loss`); `build_terms` chooses a run's terms once, from its settings. The update's loop
(`llmrl.trainer.optimization.PolicyUpdate`) knows none of them by name.
"""

from llmrl.trainer.loss_terms.base import LossTerm, MicroBatch, Step
from llmrl.trainer.loss_terms.build import LossTerms, build_terms

__all__ = ["LossTerm", "LossTerms", "MicroBatch", "Step", "build_terms"]
