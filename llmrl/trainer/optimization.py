"""One policy update: the optimizer steps of one RL step, over packed micro-batches, and AdamW.

Per step the trainer hands over a `RolloutBatch`. For each of `iterations` passes, the batch is
split into `mini_batches` (one optimizer step each, in a seeded random order when there are
several); each mini-batch is packed into micro-batches of at most `micro_batch_tokens` tokens
(`llmrl.trainer.passes`) whose losses, all divided by the mini-batch's denominator, add up to the
mini-batch loss before one clipped optimizer step.

The loss is built from the run's loss terms (`llmrl.trainer.loss_terms`: the GRPO family's policy
gradient, the reference KL, the entropy bonus, a distillation teacher's signal), chosen once by
`build_terms`. Before the first optimizer step each term prepares what it needs (no-grad passes of the
reference or the teacher, per-token advantages); in each micro-batch each adds its per-token loss, in
the terms' order, and the sum is aggregated once (`llmrl.algorithms.losses.TokenLoss`).

``pi_old`` (the denominator of the PPO ratio) is the policy before the step's first update. With one
pass and one mini-batch it equals the policy being trained, so its logprobs are the same forward's,
detached (the ratio is exactly 1 and no extra pass is needed); otherwise, or when a term needs them
before the loop (distillation compares the teacher with ``pi_old``), they come from a no-grad pass
before the first update.

When no term trains on a rollout whose advantage is exactly 0 (no KL, entropy or distillation term),
such a rollout contributes nothing but its share of the denominator, so it skips the forward and
backward passes (whole GRPO groups with equal rewards are common); the loss and gradient are
unchanged. A mini-batch with nothing left to train skips its optimizer step (there is no signal to
step on).

Over several processes (`llmrl.trainer.distributed`) every rank holds the whole batch and computes
the same denominators and mini-batches; `ForwardPasses` trains each rank on its token-balanced share
of each mini-batch (with the zero-weight passes FSDP's collectives need), shares the no-grad passes'
outputs out, and the gradients are summed across ranks.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.optim import lr_scheduler

from llmrl.algorithms.losses import LossOptions, TokenLoss
from llmrl.algorithms.packing import PackedBatch
from llmrl.config import AlgorithmConfig, ConfigError, DistillationConfig, TrainingConfig
from llmrl.inference.served_teacher import ServedTeacher
from llmrl.rollouts import RolloutBatch
from llmrl.telemetry import trace_span
from llmrl.trainer.distributed import Distributed
from llmrl.trainer.loss_terms import MicroBatch, Step, build_terms
from llmrl.trainer.metric_totals import MetricTotals
from llmrl.trainer.passes import ForwardPasses
from llmrl.types import GenerationArgs


def build_optimizer(
    model: torch.nn.Module, training: TrainingConfig
) -> tuple[torch.optim.Optimizer, lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters and its schedule (`build_schedule`), stepped once per RL step.

    The fused kernel: on CPU torch otherwise picks the per-parameter loop, which is several times slower
    on small models, and more so on a busy machine.
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        parameters, lr=training.lr, betas=training.adam_betas, weight_decay=training.weight_decay, fused=True
    )
    return optimizer, build_schedule(optimizer, training)


def build_schedule(optimizer: torch.optim.Optimizer, training: TrainingConfig) -> lr_scheduler.LRScheduler:
    """`training.lr` times (step + 1) / warmup_steps during the warm-up (steps 0-based), then the
    `lr_schedule` decay from 1 down to 0 at step `training.steps` (constant: 1 throughout)."""
    warmup = training.warmup_steps
    decay_steps = max(training.steps - warmup, 1)
    phases: list[lr_scheduler.LRScheduler] = []
    if warmup:  # 1/warmup at step 0 up to 1 at step warmup - 1 (total_iters >= 1: a 1-step warm-up is at 1)
        phases.append(
            lr_scheduler.LinearLR(optimizer, start_factor=1 / warmup, total_iters=max(warmup - 1, 1))
        )
    if training.lr_schedule == "linear":
        phases.append(
            lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=decay_steps)
        )
    elif training.lr_schedule == "cosine":
        phases.append(lr_scheduler.CosineAnnealingLR(optimizer, T_max=decay_steps))
    if not phases:
        return lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if len(phases) == 1:
        return phases[0]
    return lr_scheduler.SequentialLR(optimizer, phases, milestones=[warmup])


def fast_forward(schedule: lr_scheduler.LRScheduler, steps: int) -> None:
    """Step a fresh `schedule` to RL step `steps`, as a run that trained them would have.

    The optimizer's rates first go back to the schedule's step-0 rates: an optimizer state loaded
    from a checkpoint carries the rate of the step it was saved at, and torch's decaying schedulers
    compute each rate from the optimizer's current one, so stepping on from there would decay twice.
    """
    for group, rate in zip(schedule.optimizer.param_groups, schedule.get_last_lr(), strict=True):
        group["lr"] = rate
    with warnings.catch_warnings():  # no optimizer step comes between these, by design
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before", UserWarning)
        for _ in range(steps):
            schedule.step()


class PolicyUpdate:
    """Runs the optimisation passes of one RL step on the policy."""

    def __init__(
        self,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        algorithm: AlgorithmConfig,
        training: TrainingConfig,
        generation_args: GenerationArgs,
        max_tokens: int,
        pad_token_id: int,
        reference: torch.nn.Module | None = None,
        reference_context: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
        distributed: Distributed | None = None,
        compute_dtype: torch.dtype | None = None,
        teacher: torch.nn.Module | None = None,
        teacher_server: ServedTeacher | None = None,
        distillation: DistillationConfig | None = None,
        logits_chunk_tokens: int | None = None,
    ):
        """`compute_dtype`: see `ForwardPasses`. The models beside the policy choose the loss terms
        (`build_terms`): a KL `reference` model or a `reference_context` (inside it the policy computes
        the reference logprobs: LoRA's adapters off), and a distillation `teacher` model or `teacher_server`
        with its settings `distillation`. `logits_chunk_tokens`: see `ForwardPasses`."""
        self.policy = policy
        self.optimizer = optimizer
        self.training = training
        self.generation_args = generation_args
        self.loss_options = LossOptions.from_config(
            algorithm, max_tokens=max_tokens, generation_lag=training.generation_lag
        )
        self.passes = ForwardPasses(
            policy,
            training,
            pad_token_id=pad_token_id,
            distributed=distributed,
            compute_dtype=compute_dtype,
            logits_chunk_tokens=logits_chunk_tokens,
        )
        self.terms = build_terms(
            self.passes,
            self.loss_options,
            reference=reference,
            reference_context=reference_context,
            teacher=teacher,
            teacher_server=teacher_server,
            distillation=distillation,
        )
        self.skip_zero_advantage = not self.terms.trains_zero_advantage

    def __call__(self, batch: RolloutBatch, generator: torch.Generator) -> dict[str, float]:
        """Train on `batch`; returns the metrics: the loss's (token-weighted means over the step) and
        those the terms computed for the step (with distillation, `distill/reverse_kl`)."""
        self._check_lengths(batch)
        step, step_metrics = self._prepare(batch)
        trained = set(step.trained)
        totals = MetricTotals()
        for _ in range(self.training.iterations):
            for mini_batch in self._mini_batches(len(batch), generator):
                normalizer = batch.normalizer(
                    mini_batch, self.loss_options.aggregation, self.loss_options.max_length
                )
                chosen = [i for i in mini_batch if i in trained]
                if not chosen:
                    totals.add_skipped()
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                self._accumulate_gradients(step, chosen, normalizer, totals)
                grad_norm = self._clip_gradients()
                self.optimizer.step()
                totals.add_optimizer_step(grad_norm)
        return (
            self.passes.over_ranks(totals, MetricTotals.combine).result()
            | step_metrics
            | self.passes.route_metrics()
        )

    def _prepare(self, batch: RolloutBatch) -> tuple[Step, dict[str, float]]:
        """The step as its terms prepared it (``pi_old``'s logprobs first when any need them), and the
        terms' metrics of the step."""
        sampling_args = [r.generation_args or self.generation_args for r in batch.rollouts]
        self.passes.follow_sampling(
            sampling_args, [f"{r.env_id} problem {r.problem_id}" for r in batch.rollouts]
        )
        if self.training.router_replay:
            self.passes.follow_routes([r.routed_experts for r in batch.rollouts])
        trained = [
            i for i in range(len(batch)) if not (self.skip_zero_advantage and batch.advantages[i] == 0)
        ]
        separate_old = (
            self.training.iterations > 1 or self.training.mini_batches > 1 or self.terms.need_old_logprobs
        )
        step = Step(batch, sampling_args, trained, batch.advantages.to(self.passes.device))
        metrics: dict[str, float] = {}
        with trace_span("logprobs", old=separate_old, terms=[type(term).__name__ for term in self.terms]):
            if separate_old:
                step.old_logprobs = self.passes.sequence_logprobs(
                    self.passes.policy, step.sequences, step.masks, trained
                )
            for term in self.terms:
                metrics |= term.prepare(step)
        return step, metrics

    def _accumulate_gradients(
        self, step: Step, chosen: list[int], normalizer: float, totals: MetricTotals
    ) -> None:
        """The backward passes of this rank's micro-batches of the rollouts `chosen`."""
        for packed in self.passes.micro_batches(step.sequences, step.masks, chosen):
            if packed is None:
                self.passes.idle_pass(
                    self.passes.policy, step.sequences, step.masks, chosen[0], backward=True
                )
                continue
            with self.passes.routed(self.passes.policy, packed):
                loss, metrics = self._loss(step, packed, normalizer)
                loss.backward()
            totals.add_micro_batch(metrics)

    def _loss(
        self, step: Step, packed: PackedBatch, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss: every term's per-token loss, in the terms' order, aggregated once."""
        with self.passes.compute():
            policy = self.terms.forward(packed)
        micro = MicroBatch(
            step, packed, policy, TokenLoss(policy.logprobs, packed.loss_mask, packed.sequence_ids)
        )
        for term in self.terms:
            term.add_loss(micro)
        loss = micro.loss.aggregate(self.loss_options.aggregation, self.loss_options.max_length, normalizer)
        for term in self.terms:
            micro.loss.metrics.update(term.statistics(micro))
        micro.loss.metrics.update(micro.loss.counts())
        return loss, micro.loss.metrics

    def _check_lengths(self, batch: RolloutBatch) -> None:
        budget = self.training.micro_batch_tokens
        too_long = [(r.problem_id, len(r.tokens)) for r in batch.rollouts if len(r.tokens) > budget]
        if too_long:
            problem, length = max(too_long, key=lambda item: item[1])
            raise ConfigError(
                f"training.micro_batch_tokens: a rollout of {length} tokens (problem {problem}) does not fit "
                f"the micro-batch budget of {budget} tokens; raise training.micro_batch_tokens to at least {length}"
            )

    def _mini_batches(self, size: int, generator: torch.Generator) -> Iterator[list[int]]:
        count = self.training.mini_batches
        order = torch.randperm(size, generator=generator).tolist() if count > 1 else list(range(size))
        for k in range(count):
            yield order[k * size // count : (k + 1) * size // count]

    def _clip_gradients(self) -> float:
        parameters = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.training.max_grad_norm if self.training.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # sharded: the global norm
