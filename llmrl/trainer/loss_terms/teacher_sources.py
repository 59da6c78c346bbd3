"""Where a distillation term's teacher scores come from: a model in the trainer's processes
(`LoadedTeacher`, `distillation.teacher`) or an inference server (`ServedTeacherScores`,
`distillation.teacher_server`). Both give each trained rollout the same tensors, so the terms cannot
tell them apart."""

from __future__ import annotations

from typing import Protocol

from llmrl.algorithms.logprobs import token_top_k
from llmrl.algorithms.packing import PackedBatch
from llmrl.config import ConfigError
from llmrl.inference.served_teacher import ServedTeacher, TeacherOutputs
from llmrl.trainer.loss_terms.base import Step
from llmrl.trainer.passes import ForwardPasses, Model, merged_shares


class Teacher(Protocol):
    def outputs(self, step: Step, top_k: int | None) -> list[TeacherOutputs | None]:
        """For each rollout of `step` it trains (None for the others), on every rank: its tokens'
        logprobs under the teacher, and with `top_k` the teacher's top k at each position
        (`llmrl.inference.served_teacher.TeacherOutputs`), of the distribution each token was sampled
        from."""
        ...


class LoadedTeacher:
    """A frozen model beside the policy, run by the step's no-grad passes (sharded like the reference)."""

    def __init__(self, passes: ForwardPasses, model: Model):
        self.passes = passes
        self.model = model

    def outputs(self, step: Step, top_k: int | None) -> list[TeacherOutputs | None]:
        if top_k is None:
            logprobs = self.passes.sequence_logprobs(self.model, step.sequences, step.masks, step.trained)
            return [None if values is None else (values,) for values in logprobs]

        def score(model: Model, packed: PackedBatch) -> TeacherOutputs:
            return token_top_k(
                model, packed, self.passes.token_sampling(packed), top_k, self.passes.logits_chunk_tokens
            )

        return self.passes.sequence_outputs(self.model, step.sequences, step.masks, step.trained, score)


class ServedTeacherScores:
    """A teacher behind a server: each rank asks for its share of the trained rollouts, or with
    `main_asks_all` rank 0 for all of them (a server it started, on its own loopback), and every rank gets
    all of them, as from the passes."""

    def __init__(self, passes: ForwardPasses, server: ServedTeacher, *, main_asks_all: bool = False):
        self.passes = passes
        self.server = server
        self.main_asks_all = main_asks_all

    def outputs(self, step: Step, top_k: int | None) -> list[TeacherOutputs | None]:
        distributed = self.passes.distributed
        if distributed is None:
            mine = step.trained
        elif self.main_asks_all:
            mine = step.trained if distributed.rank == 0 else []
        else:
            mine = step.trained[distributed.rank :: distributed.world_size]
        for i in mine:
            filters = step.sampling_args[i].filters
            if filters:
                rollout = step.batch.rollouts[i]
                raise ConfigError(
                    f"distillation.teacher_server: {rollout.env_id} problem {rollout.problem_id} was sampled "
                    f"with {', '.join(filters)}, but a served teacher scores whole distributions; sample "
                    "without filters or load the teacher in process (distillation.teacher)"
                )
        scored = self.server.score(
            [step.sequences[i] for i in mine],
            [step.masks[i] for i in mine],
            [step.sampling_args[i].temperature for i in mine],
            top_k,
        )
        values: list[TeacherOutputs | None] = [None] * len(step.sequences)
        for i, outputs in zip(mine, scored, strict=True):
            values[i] = outputs
        return self.passes.over_ranks(values, merged_shares)
