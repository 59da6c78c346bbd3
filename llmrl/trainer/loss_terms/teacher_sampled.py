"""Distillation's sampled signal (`distillation.signal: sampled`): per-token advantages."""

from __future__ import annotations

import torch

from llmrl.algorithms.distillation import distillation_advantages
from llmrl.trainer.loss_terms.base import MicroBatch, Step
from llmrl.trainer.loss_terms.teacher import TeacherTerm


class TeacherSampled(TeacherTerm):
    """Each token's advantage gains ``coef * (teacher - pi_old)`` of its sampled token, fixed for the
    whole step; the policy-gradient term trains on it, so this term adds no loss of its own."""

    def prepare(self, step: Step) -> dict[str, float]:
        teacher = [None if o is None else o[0] for o in self.teacher.outputs(step, None)]
        metrics = self._teacher_metrics(step, teacher)
        step.token_advantages = self._token_advantages(step, teacher)
        return metrics

    def add_loss(self, micro: MicroBatch) -> None:
        pass

    def _token_advantages(self, step: Step, teacher: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each sequence's per-token distillation advantages (zeros for those not trained)."""
        assert step.old_logprobs is not None
        values = [torch.zeros(len(r.tokens)) for r in step.batch.rollouts]
        for i in step.trained:
            teacher_i, old_i = teacher[i], step.old_logprobs[i]
            assert teacher_i is not None and old_i is not None
            mask = torch.tensor(step.batch.rollouts[i].mask)
            values[i] = distillation_advantages(teacher_i, old_i, mask, self.distillation.coef)
        return values
