"""What the distillation terms share: the teacher's pass beside ``pi_old``'s, the `rewards` setting and
the sampled reverse-KL metrics (`llmrl.algorithms.distillation`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrl.algorithms.distillation import reverse_kl_sums
from llmrl.config import DistillationConfig
from llmrl.rollouts import RolloutBatch
from llmrl.trainer.loss_terms.base import LossTerm, Step
from llmrl.trainer.loss_terms.teacher_sources import Teacher
from llmrl.trainer.passes import ForwardPasses


class TeacherTerm(LossTerm):
    """A distillation signal. The teacher's side is compared with ``pi_old``, not the engine's sampling
    logprobs: computed by the same forward code as the teacher's, it makes a teacher equal to the policy
    give exactly 0, and the engine's difference from it is the trainer/inference mismatch that
    `is_mode` corrects. The `teacher` is loaded or served (`teacher_sources`)."""

    # Distillation gives nearly every token a signal of its own, whatever its rollout's reward advantage.
    trains_zero_advantage = True
    needs_old_logprobs = True

    def __init__(self, passes: ForwardPasses, teacher: Teacher, distillation: DistillationConfig):
        super().__init__(passes)
        self.teacher = teacher
        self.distillation = distillation

    def _teacher_metrics(self, step: Step, teacher: list[torch.Tensor | None]) -> dict[str, float]:
        """With `rewards: ignore` the teacher alone trains the policy; the step's reverse-KL metrics."""
        assert step.old_logprobs is not None
        if self.distillation.rewards == "ignore":
            step.advantages = torch.zeros_like(step.advantages)
        return reverse_kl_metrics(step.batch, teacher, step.old_logprobs, step.trained)


def reverse_kl_metrics(
    batch: RolloutBatch,
    teacher: list[torch.Tensor | None],
    old: list[torch.Tensor | None],
    indices: Sequence[int],
) -> dict[str, float]:
    """Mean over the sampled tokens of ``pi_old - teacher`` (the reverse-KL estimate), over the step and
    per environment."""
    sums: dict[str, list[float]] = {}
    for i in indices:
        teacher_i, old_i = teacher[i], old[i]
        assert teacher_i is not None and old_i is not None
        total, count = reverse_kl_sums(teacher_i, old_i, torch.tensor(batch.rollouts[i].mask))
        for key in ("distill/reverse_kl", f"distill/{batch.rollouts[i].env_id}/reverse_kl"):
            running = sums.setdefault(key, [0.0, 0.0])
            running[0] += total
            running[1] += count
    return {key: total / count for key, (total, count) in sums.items() if count}
