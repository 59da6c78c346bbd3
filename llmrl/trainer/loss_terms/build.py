"""The terms a run trains with, chosen once from its settings and models."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from llmrl.algorithms.losses import LossOptions
from llmrl.config import DistillationConfig
from llmrl.inference.served_teacher import ServedTeacher
from llmrl.trainer.loss_terms.base import LossTerm
from llmrl.trainer.loss_terms.entropy import EntropyBonus
from llmrl.trainer.loss_terms.policy_gradient import PolicyGradient
from llmrl.trainer.loss_terms.reference_kl import ReferenceKL
from llmrl.trainer.loss_terms.teacher_sampled import TeacherSampled
from llmrl.trainer.loss_terms.teacher_sources import LoadedTeacher, ServedTeacherScores, Teacher
from llmrl.trainer.loss_terms.teacher_top_k import TeacherTopK
from llmrl.trainer.passes import ForwardPasses, PolicyForward


@dataclass(frozen=True)
class LossTerms:
    """A run's terms, in the order their per-token losses add up, and the policy's forward they share."""

    terms: list[LossTerm]
    forward: PolicyForward

    def __iter__(self) -> Iterator[LossTerm]:
        return iter(self.terms)

    @property
    def trains_zero_advantage(self) -> bool:
        return any(term.trains_zero_advantage for term in self.terms)

    @property
    def need_old_logprobs(self) -> bool:
        return any(term.needs_old_logprobs for term in self.terms)


def build_terms(
    passes: ForwardPasses,
    options: LossOptions,
    *,
    reference: torch.nn.Module | None = None,
    reference_context: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    teacher: torch.nn.Module | None = None,
    teacher_server: ServedTeacher | None = None,
    distillation: DistillationConfig | None = None,
) -> LossTerms:
    """The policy-gradient term, then the reference KL (with a `reference` model, or a `reference_context`
    inside which the policy is the reference), the entropy bonus (every run logs the entropy) and the
    distillation teacher's signal: a `teacher` model or a `teacher_server`, with its settings
    `distillation` (one teacher and its settings, or neither)."""
    if (distillation is None) != (teacher is None and teacher_server is None) or (
        teacher is not None and teacher_server is not None
    ):
        raise ValueError(
            "a distillation teacher (a model or a server) needs its settings, and the settings one teacher"
        )
    terms: list[LossTerm] = [PolicyGradient(passes, options)]
    if reference is not None:
        terms.append(ReferenceKL(passes, options, passes.runnable(reference)))
    elif reference_context is not None:
        terms.append(ReferenceKL(passes, options, passes.policy, reference_context))
    terms.append(EntropyBonus(passes, options.entropy_coef))
    forward: PolicyForward = passes.policy_tokens
    if distillation is not None:
        source: Teacher
        if teacher_server is not None:
            served = distillation.teacher_server
            started = served is not None and served.serve is not None
            source = ServedTeacherScores(passes, teacher_server, main_asks_all=started)
        else:
            assert teacher is not None
            source = LoadedTeacher(passes, passes.runnable(teacher))
        if distillation.signal == "top_k":
            top_k = TeacherTopK(passes, source, distillation)
            terms.append(top_k)
            forward = top_k.policy_tokens
        else:
            terms.append(TeacherSampled(passes, source, distillation))
    return LossTerms(terms, forward)
