"""One policy update: packed micro-batches, old/reference logprobs, the GRPO-family loss, AdamW.

Per step the trainer hands over a `RolloutBatch`. For each of `iterations` passes, the batch is
split into `mini_batches` (one optimizer step each, in a seeded random order when there are
several); each mini-batch is packed into micro-batches of at most `micro_batch_tokens` tokens whose
losses, all divided by the mini-batch's denominator, add up to the mini-batch loss before one
clipped optimizer step.

``pi_old`` (the denominator of the PPO ratio) is the policy before the step's first update. With one
pass and one mini-batch it equals the policy being trained, so its logprobs are the same forward's,
detached (the ratio is exactly 1 and no extra pass is needed); otherwise they come from a no-grad
pass before the first update. The reference model's logprobs (``kl_beta > 0``) also come from one
no-grad pass per step: of the reference model, or, with LoRA, of the policy with its adapters off.

With on-policy distillation (`distillation`) the teacher comes in one more no-grad pass (sharded like
the reference's), and ``pi_old`` always from its own no-grad pass of the policy
(`llmrl.algorithms.distillation`). With `signal: top_k` the teacher's pass keeps its top-k logprobs at
each completion position, and each micro-batch's forward computes the policy's reverse KL to them from
the same logits as its logprobs: a loss term weighted by `coef`, beside the reward advantages (or
instead of them, `rewards: ignore`). With `signal: sampled` each token's advantage becomes its
rollout's reward advantage (or 0) plus ``coef * (teacher - pi_old)``, fixed for the whole step. The
policy's side is ``pi_old``, not the engine's sampling logprobs: computed by the same forward code as
the teacher's, it makes a teacher equal to the policy give exactly 0, and the engine's difference from
it is the trainer/inference mismatch that `is_mode` corrects.

When the loss has no KL or entropy term, a rollout with advantage exactly 0 contributes nothing but
its share of the denominator, so it skips the forward and backward passes (whole GRPO groups with
equal rewards are common); the loss and gradient are unchanged. A mini-batch with nothing left to
train skips its optimizer step (there is no signal to step on).

Over several processes (`llmrl.trainer.distributed`) every rank holds the whole batch and computes
the same denominators and mini-batches; each packs and trains on its token-balanced share of each
mini-batch, runs zero-weight passes where it has fewer micro-batches than another rank (FSDP's
collectives need the same number of passes everywhere), and the gradients are summed across
ranks. The old/reference logprobs are computed the same way, shared out and gathered back.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.optim import lr_scheduler

from llmrl.algorithms.distillation import distillation_advantages, reverse_kl_sums
from llmrl.algorithms.logprobs import (
    SamplingParams,
    token_logprobs,
    token_logprobs_and_teacher_kl,
    token_top_k,
)
from llmrl.algorithms.losses import LossOptions, policy_loss
from llmrl.algorithms.packing import (
    PackedBatch,
    Unit,
    build_batch,
    has_local_attention,
    pack,
    pack_values,
    plan_rows,
    unit_tokens,
    unpack,
)
from llmrl.config import AlgorithmConfig, ConfigError, DistillationConfig, TrainingConfig
from llmrl.models.shape import ModelShape
from llmrl.rollouts import RolloutBatch
from llmrl.telemetry import trace_span
from llmrl.trainer.distributed import Distributed, ShardedCausalLM, split_by_tokens
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
    """Runs the optimisation passes of one RL step on the policy (and reads the reference model)."""

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
        distillation: DistillationConfig | None = None,
    ):
        """`compute_dtype`: the dtype forward and backward passes run in, when it is not the dtype of
        the policy's trained parameters (the master weights'): one process runs them under autocast;
        sharded models cast on their own (FSDP2's `MixedPrecisionPolicy`, set by `Distributed.shard`).
        `reference_context`: inside it the policy computes the reference logprobs (LoRA's adapters
        off), in place of a `reference` model. `teacher`: the distillation teacher, with its settings
        `distillation` (both or neither)."""
        if (teacher is None) != (distillation is None):
            raise ValueError("a distillation teacher needs its settings, and the settings a teacher")
        self.policy = policy
        self.distributed = distributed
        self.optimizer = optimizer
        self.training = training
        self.generation_args = generation_args
        self.loss_options = LossOptions.from_config(
            algorithm, max_tokens=max_tokens, generation_lag=training.generation_lag
        )
        self.pad_token_id = pad_token_id
        self.reference = reference
        self.reference_context = reference_context
        self.teacher = teacher
        self.distillation = distillation
        # Distillation gives nearly every token a signal of its own, whatever its rollout's reward advantage.
        self.skip_zero_advantage = algorithm.kl_beta == 0 and algorithm.entropy_coef == 0 and teacher is None
        shape = ModelShape.of(policy)  # packing's costs: forward FLOPs per token and per attention pair
        self._token_cost, self._pair_cost = shape.token_flops, shape.pair_flops
        # A shared prefix brings its own attention mask, which would drop a sliding window.
        self._local_attention = has_local_attention(getattr(policy, "config", None))
        self.device = next(policy.parameters()).device
        master_dtype = next(p for p in policy.parameters() if p.requires_grad).dtype
        self._autocast_dtype = (
            compute_dtype if distributed is None and compute_dtype not in (None, master_dtype) else None
        )
        self._policy_forward = policy if distributed is None else ShardedCausalLM(policy)
        self._reference_forward = (
            reference if distributed is None or reference is None else ShardedCausalLM(reference)
        )
        self._teacher_forward = (
            teacher if distributed is None or teacher is None else ShardedCausalLM(teacher)
        )

    def __call__(self, batch: RolloutBatch, generator: torch.Generator) -> dict[str, float]:
        """Train on `batch`; returns the metrics (token-weighted means over the step): the loss's, and
        with distillation the reverse KL to the teacher (`distill/reverse_kl`, `distill/ENV/reverse_kl`)."""
        self._check_lengths(batch)
        self._sampling = sampling_params(
            [r.generation_args or self.generation_args for r in batch.rollouts],
            [f"{r.env_id} problem {r.problem_id}" for r in batch.rollouts],
        )
        top_k = self.distillation is not None and self.distillation.signal == "top_k"
        if top_k:
            self._check_whole_distributions(batch)
        sequences, masks = batch.sequences, batch.loss_masks
        forwarded = [
            i for i in range(len(batch)) if not (self.skip_zero_advantage and batch.advantages[i] == 0)
        ]
        is_forwarded = set(forwarded)
        separate_old = (
            self.training.iterations > 1 or self.training.mini_batches > 1 or self.teacher is not None
        )
        has_reference = self.reference is not None or self.reference_context is not None
        teacher, teacher_top = None, None
        with trace_span(
            "logprobs", old=separate_old, reference=has_reference, teacher=self.teacher is not None
        ):
            old = (
                self._sequence_logprobs(self._policy_forward, sequences, masks, forwarded)
                if separate_old
                else None
            )
            ref = None
            if self.reference is not None:
                ref = self._sequence_logprobs(self._reference_forward, sequences, masks, forwarded)
            elif self.reference_context is not None:
                with self.reference_context():
                    ref = self._sequence_logprobs(self._policy_forward, sequences, masks, forwarded)
            if top_k:
                assert self.distillation is not None
                scored = self._sequence_outputs(
                    self._teacher_forward,
                    sequences,
                    masks,
                    forwarded,
                    self._top_k_scorer(self.distillation.top_k),
                )
                teacher = [None if s is None else s[0] for s in scored]
                teacher_top = [None if s is None else s[1:] for s in scored]
            elif self.teacher is not None:
                teacher = self._sequence_logprobs(self._teacher_forward, sequences, masks, forwarded)
        inference = batch.inference_logprobs
        advantages = batch.advantages.to(self.device)
        token_advantages, distill_metrics = None, {}
        if teacher is not None:
            assert old is not None and self.distillation is not None
            if self.distillation.rewards == "ignore":
                advantages = torch.zeros_like(advantages)
            if not top_k:
                token_advantages = self._distillation_advantages(batch, teacher, old, forwarded)
            distill_metrics = _reverse_kl_metrics(batch, teacher, old, forwarded)
        totals = _MetricTotals()
        for _ in range(self.training.iterations):
            for mini_batch in self._mini_batches(len(batch), generator):
                normalizer = batch.normalizer(
                    mini_batch, self.loss_options.aggregation, self.loss_options.max_length
                )
                chosen = [i for i in mini_batch if i in is_forwarded]
                if not chosen:
                    totals.add_skipped()
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                for packed in self._rank_micro_batches(sequences, masks, chosen):
                    if packed is None:
                        self._idle_pass(self._policy_forward, sequences, masks, chosen[0], backward=True)
                        continue
                    loss, metrics = self._loss(
                        packed, advantages, normalizer, old, ref, inference, token_advantages, teacher_top
                    )
                    loss.backward()
                    totals.add_micro_batch(metrics)
                grad_norm = self._clip_gradients()
                self.optimizer.step()
                totals.add_optimizer_step(grad_norm)
        if self.distributed is not None:
            totals = _MetricTotals.combine(self.distributed.all_gather_object(totals))
        return totals.result() | distill_metrics

    # -- pieces ----------------------------------------------------------------------------------

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

    def _layout(
        self, sequences: list[list[int]], masks: list[list[bool]], indices: Sequence[int]
    ) -> tuple[list[Unit], int]:
        """Packing units (the rollouts of one prompt may share it) and the row length, by `plan_rows`."""
        longest_row = min(self.training.pack_row_tokens, self.training.micro_batch_tokens)
        return plan_rows(
            sequences,
            masks,
            indices,
            longest_row,
            token_cost=self._token_cost,
            pair_cost=self._pair_cost,
            share=self.training.share_prefixes and not self._local_attention,
        )

    def _micro_batches(
        self, sequences: list[list[int]], masks: list[list[bool]], units: list[Unit], row_limit: int
    ) -> Iterator[PackedBatch]:
        """Packed micro-batches of `units`: rows of at most `row_limit` tokens (or the longest unit),
        as many rows per micro-batch as fit `micro_batch_tokens`."""
        lengths = [len(s) for s in sequences]
        unit_lengths = [unit_tokens(unit, lengths) for unit in units]
        rows = pack(unit_lengths, max(row_limit, *unit_lengths))
        chosen: list[list[Unit]] = []
        width = 0
        for row in rows:  # first-fit-decreasing: the fullest rows come first
            row_tokens = sum(unit_lengths[j] for j in row)
            if chosen and max(width, row_tokens) * (len(chosen) + 1) > self.training.micro_batch_tokens:
                yield self._build(sequences, masks, chosen)
                chosen, width = [], 0
            chosen.append([units[j] for j in row])
            width = max(width, row_tokens)
        if chosen:
            yield self._build(sequences, masks, chosen)

    def _build(
        self, sequences: list[list[int]], masks: list[list[bool]], rows: list[list[Unit]]
    ) -> PackedBatch:
        return build_batch(sequences, rows, masks, self.pad_token_id).to(self.device)

    def _rank_micro_batches(
        self, sequences: list[list[int]], masks: list[list[bool]], indices: Sequence[int]
    ) -> Iterator[PackedBatch | None]:
        """This rank's micro-batches of the sequences at `indices`, then None for each pass it must
        run idle to match the rank with the most (all of them on one process)."""
        units, row_limit = self._layout(sequences, masks, indices)
        if self.distributed is None:
            yield from self._micro_batches(sequences, masks, units, row_limit)
            return
        lengths = [len(s) for s in sequences]
        shares = split_by_tokens([unit_tokens(unit, lengths) for unit in units], self.distributed.world_size)
        mine = [units[p] for p in shares[self.distributed.rank]]
        batches = list(self._micro_batches(sequences, masks, mine, row_limit)) if mine else []
        passes = self.distributed.max_count(len(batches))  # before any pass: a collective itself
        yield from batches
        yield from [None] * (passes - len(batches))

    def _idle_pass(
        self,
        model: torch.nn.Module | ShardedCausalLM,
        sequences: list[list[int]],
        masks: list[list[bool]],
        index: int,
        *,
        backward: bool,
    ) -> None:
        """A forward (and backward) pass that changes nothing, for FSDP's collectives to match up."""
        packed = self._build(sequences, masks, [[index]])
        with torch.set_grad_enabled(backward), self._compute():
            logprobs, _ = token_logprobs(model, packed, self._token_sampling(packed))
            if backward:
                (logprobs.sum() * 0.0).backward()

    def _sequence_logprobs(
        self,
        model: torch.nn.Module | ShardedCausalLM | None,
        sequences: list[list[int]],
        masks: list[list[bool]],
        indices: Sequence[int],
    ) -> list[torch.Tensor | None]:
        """Per-token logprobs of the sequences at `indices` under `model` (None for the others)."""
        outputs = self._sequence_outputs(
            model,
            sequences,
            masks,
            indices,
            lambda m, packed: token_logprobs(m, packed, self._token_sampling(packed))[:1],
        )
        return [None if o is None else o[0] for o in outputs]

    @torch.no_grad()
    def _sequence_outputs(
        self,
        model: torch.nn.Module | ShardedCausalLM | None,
        sequences: list[list[int]],
        masks: list[list[bool]],
        indices: Sequence[int],
        score: Callable[[torch.nn.Module | ShardedCausalLM, PackedBatch], tuple[torch.Tensor, ...]],
    ) -> list[tuple[torch.Tensor, ...] | None]:
        """What `score` computes per token (``[R, T, ...]`` tensors of a packed batch) for each sequence at
        `indices`, split back per sequence (None for the others)."""
        values: list[tuple[torch.Tensor, ...] | None] = [None] * len(sequences)
        if not indices:  # nothing to train on (every rank holds the same batch, so all return here)
            return values
        for packed in self._rank_micro_batches(sequences, masks, indices):
            if packed is None:
                self._idle_pass(model, sequences, masks, indices[0], backward=False)
                continue
            with self._compute():
                outputs = [unpack(output, packed) for output in score(model, packed)]
            for i in outputs[0]:
                values[i] = tuple(output[i].cpu() for output in outputs)
        if self.distributed is not None:  # every rank trains on other shares in later passes
            for shared in self.distributed.all_gather_object(values):
                for i, per_token in enumerate(shared):
                    if per_token is not None:
                        values[i] = per_token
        return values

    def _top_k_scorer(
        self, k: int
    ) -> Callable[[torch.nn.Module | ShardedCausalLM, PackedBatch], tuple[torch.Tensor, ...]]:
        """A `_sequence_outputs` scorer of a teacher: its logprobs, and its top-`k` logprobs and ids."""
        return lambda model, packed: token_top_k(model, packed, self._token_sampling(packed), k)

    def _check_whole_distributions(self, batch: RolloutBatch) -> None:
        """`signal: top_k` compares whole distributions: a rollout sampled through filters is refused."""
        for rollout in batch.rollouts:
            filters = (rollout.generation_args or self.generation_args).filters
            if filters:
                raise ConfigError(
                    f"distillation.signal: {rollout.env_id} problem {rollout.problem_id} was sampled with "
                    f"{', '.join(filters)}, but signal top_k compares whole distributions; sample without "
                    "filters or use signal: sampled"
                )

    def _distillation_advantages(
        self,
        batch: RolloutBatch,
        teacher: list[torch.Tensor | None],
        old: list[torch.Tensor | None],
        indices: Sequence[int],
    ) -> list[torch.Tensor]:
        """Each sequence's per-token distillation advantages (zeros for those not at `indices`)."""
        assert self.distillation is not None
        values = [torch.zeros(len(r.tokens)) for r in batch.rollouts]
        for i in indices:
            teacher_i, old_i = teacher[i], old[i]
            assert teacher_i is not None and old_i is not None
            mask = torch.tensor(batch.rollouts[i].mask)
            values[i] = distillation_advantages(teacher_i, old_i, mask, self.distillation.coef)
        return values

    def _loss(
        self,
        packed: PackedBatch,
        advantages: torch.Tensor,
        normalizer: float,
        old: list[torch.Tensor | None] | None,
        ref: list[torch.Tensor | None] | None,
        inference: list[list[float]] | None,
        token_advantages: list[torch.Tensor] | None,
        teacher_top: list[tuple[torch.Tensor, ...] | None] | None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """`token_advantages` (distillation, `signal: sampled`): per-token advantages of each sequence,
        added to its reward advantage. `teacher_top` (`signal: top_k`): each sequence's teacher top-k
        logprobs and ids, whose reverse KL from the policy joins the loss."""
        teacher_kl = None
        with self._compute():
            if teacher_top is None:
                logprobs, entropies = token_logprobs(
                    self._policy_forward, packed, self._token_sampling(packed), with_entropy=True
                )
            else:
                logprobs, entropies, teacher_kl = token_logprobs_and_teacher_kl(
                    self._policy_forward,
                    packed,
                    self._token_sampling(packed),
                    pack_values([t and t[0] for t in teacher_top], packed).to(self.device),
                    pack_values([t and t[1] for t in teacher_top], packed, dtype=torch.int64).to(self.device),
                    with_entropy=True,
                )
        if self.loss_options.entropy_coef == 0:
            entropies = entropies.detach()  # a metric only: no backward through it
        if token_advantages is not None:  # padding (-1) takes sequence 0's: off the mask, never scored
            advantages = advantages[packed.sequence_ids.clamp(min=0)] + pack_values(token_advantages, packed)
        return policy_loss(
            logprobs,
            logprobs.detach() if old is None else pack_values(old, packed),
            advantages,
            packed.loss_mask,
            self.loss_options,
            normalizer=normalizer,
            ref_logprobs=None if ref is None else pack_values(ref, packed),
            entropies=entropies,
            inference_logprobs=None if inference is None else pack_values(inference, packed),
            sequence_ids=packed.sequence_ids,
            teacher_kl=teacher_kl,
            teacher_coef=self.distillation.coef if self.distillation is not None else 1.0,
        )

    def _compute(self) -> contextlib.AbstractContextManager:
        """Where forward passes run in the compute dtype over master weights of another (one process)."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def _token_sampling(self, packed: PackedBatch) -> float | SamplingParams:
        """The step's sampling options laid out like `packed` (each token gets its sequence's)."""
        if isinstance(self._sampling, float):
            return self._sampling
        owners = packed.sequence_ids.clamp(min=0)  # padding (-1) takes sequence 0's: never scored
        return self._sampling.map(lambda values: values.to(owners.device)[owners])

    def _clip_gradients(self) -> float:
        parameters = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.training.max_grad_norm if self.training.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # sharded: the global norm


def sampling_params(args: Sequence[GenerationArgs], names: Sequence[str]) -> float | SamplingParams:
    """What the trainer's logprobs of each rollout must follow: its sampling options (`llmrl.types`).

    One temperature when every rollout was sampled alike without filters (the usual case), else
    per-rollout `SamplingParams` tensors. Options the trainer cannot reproduce are refused, naming
    the first rollout (`names[i]`) that used one.
    """
    for options, name in zip(args, names, strict=True):
        if options.temperature == 0:
            raise ConfigError(
                f"{name} was decoded greedily (temperature 0): there is no distribution to train on"
            )
        refused = options.untrainable_options
        if refused:
            raise ConfigError(
                f"{name} was sampled with {refused}, which the trainer cannot reproduce in its logprobs; use these "
                "options only in environments with evaluation_only: true"
            )
    temperatures = torch.tensor([a.temperature for a in args], dtype=torch.float32)
    top_k, top_p, min_p = ([getattr(a, name) for a in args] for name in ("top_k", "top_p", "min_p"))
    if not any(a.filters for a in args) and len(set(temperatures.tolist())) <= 1:
        return args[0].temperature if args else 1.0
    return SamplingParams(
        temperature=temperatures,
        top_k=torch.tensor(top_k, dtype=torch.int64) if any(top_k) else None,
        top_p=torch.tensor(top_p, dtype=torch.float32) if any(p < 1.0 for p in top_p) else None,
        min_p=torch.tensor(min_p, dtype=torch.float32) if any(min_p) else None,
    )


def _reverse_kl_metrics(
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


class _MetricTotals:
    """Combines `policy_loss` metrics over micro-batches and optimizer steps.

    Losses add up over the micro-batches of an optimizer step (they share its denominator) and are
    averaged over steps; maxima stay maxima; everything else is weighted by its token count.
    """

    _SUMMED = ("loss", "pg_loss")
    _MAXED = ("is_weight_max",)
    _COUNTS = ("num_tokens", "num_sequences")

    def __init__(self) -> None:
        self._weighted: dict[str, float] = {}
        self._tokens = 0.0
        self._step_sums: dict[str, float] = {}
        self._sums: dict[str, float] = {}
        self._maxima: dict[str, float] = {}
        self._counts: dict[str, float] = {}
        self._grad_norms: list[float] = []
        self._skipped = 0

    def add_micro_batch(self, metrics: dict[str, float]) -> None:
        tokens = metrics["num_tokens"]
        self._tokens += tokens
        for key, value in metrics.items():
            if key in self._SUMMED:
                self._step_sums[key] = self._step_sums.get(key, 0.0) + value
            elif key in self._MAXED:
                self._maxima[key] = max(self._maxima.get(key, -math.inf), value)
            elif key in self._COUNTS:
                self._counts[key] = self._counts.get(key, 0.0) + value
            else:
                self._weighted[key] = self._weighted.get(key, 0.0) + value * tokens

    def add_optimizer_step(self, grad_norm: float) -> None:
        for key, value in self._step_sums.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
        self._step_sums = {}
        self._grad_norms.append(grad_norm)

    def add_skipped(self) -> None:
        self._skipped += 1

    @classmethod
    def combine(cls, parts: list[_MetricTotals]) -> _MetricTotals:
        """The totals of one step trained in shares (one per rank, same optimizer steps) as one."""
        combined = cls()
        for part in parts:
            combined._tokens += part._tokens
            for target, source in (
                (combined._weighted, part._weighted),
                (combined._sums, part._sums),
                (combined._counts, part._counts),
            ):
                for key, value in source.items():
                    target[key] = target.get(key, 0.0) + value
            for key, value in part._maxima.items():
                combined._maxima[key] = max(combined._maxima.get(key, -math.inf), value)
        combined._grad_norms = list(parts[0]._grad_norms)  # global norms: the same on every rank
        combined._skipped = parts[0]._skipped
        return combined

    def result(self) -> dict[str, float]:
        steps = len(self._grad_norms)
        out = {key: value / steps for key, value in self._sums.items()} if steps else {"loss": 0.0}
        out.update({key: value / self._tokens for key, value in self._weighted.items() if self._tokens})
        out.update(self._maxima)
        out.update(self._counts)
        out["grad_norm"] = sum(self._grad_norms) / steps if steps else 0.0
        out["optimizer_steps"] = float(steps)
        out["skipped_updates"] = float(self._skipped)
        return out
