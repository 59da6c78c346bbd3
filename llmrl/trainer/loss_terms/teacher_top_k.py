"""Distillation's top-k signal (`distillation.signal: top_k`): the reverse KL to the teacher's top k."""

from __future__ import annotations

import torch

from llmrl.algorithms.logprobs import token_logprobs_and_teacher_kl
from llmrl.algorithms.packing import PackedBatch, pack_values
from llmrl.config import ConfigError, DistillationConfig
from llmrl.trainer.loss_terms.base import MicroBatch, Step
from llmrl.trainer.loss_terms.teacher import TeacherTerm
from llmrl.trainer.loss_terms.teacher_sources import Teacher
from llmrl.trainer.passes import ForwardPasses, PolicyTokens


class TeacherTopK(TeacherTerm):
    """The teacher's pass keeps its top-k logprobs at each completion position; each micro-batch's
    forward computes the policy's reverse KL to them from the same logits as its logprobs (so this term
    runs the policy's forward, `policy_tokens`), a loss term weighted by `coef`."""

    def __init__(self, passes: ForwardPasses, teacher: Teacher, distillation: DistillationConfig):
        super().__init__(passes, teacher, distillation)
        self._top: list[tuple[torch.Tensor, ...] | None] = []

    def prepare(self, step: Step) -> dict[str, float]:
        self._check_whole_distributions(step)
        scored = self.teacher.outputs(step, self.distillation.top_k)
        self._top = [None if s is None else s[1:] for s in scored]
        return self._teacher_metrics(step, [None if s is None else s[0] for s in scored])

    def policy_tokens(self, packed: PackedBatch) -> PolicyTokens:
        device = self.passes.device
        logprobs, entropies, kl = token_logprobs_and_teacher_kl(
            self.passes.policy,
            packed,
            self.passes.token_sampling(packed),
            pack_values([t and t[0] for t in self._top], packed).to(device),
            pack_values([t and t[1] for t in self._top], packed, dtype=torch.int64).to(device),
            with_entropy=True,
            chunk_size=self.passes.logits_chunk_tokens,
        )
        assert entropies is not None
        return PolicyTokens(logprobs, entropies, kl)

    def add_loss(self, micro: MicroBatch) -> None:
        assert micro.policy.logits_loss is not None, "the micro-batch's forward was this term's"
        micro.loss.add_weighted("teacher_kl", micro.policy.logits_loss, self.distillation.coef)

    def _check_whole_distributions(self, step: Step) -> None:
        """`signal: top_k` compares whole distributions: a rollout sampled through filters is refused."""
        for rollout, args in zip(step.batch.rollouts, step.sampling_args, strict=True):
            filters = args.filters
            if filters:
                raise ConfigError(
                    f"distillation.signal: {rollout.env_id} problem {rollout.problem_id} was sampled with "
                    f"{', '.join(filters)}, but signal top_k compares whole distributions; sample without "
                    "filters or use signal: sampled"
                )
