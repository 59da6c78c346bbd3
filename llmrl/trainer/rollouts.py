"""From a step's rollout groups to what the optimiser trains on, plus the rollout metrics.

`prepare_batch` applies the reward shaping (DAPO soft overlong punishment), computes the group
advantages and picks the rollouts that reach the loss:

- placeholders (failed rollouts) never do; they are also left out of their group's statistics;
- an episode of several token sequences (`TokenRollout.extra_sequences`) brings each of them, with
  the episode's advantage;
- with `mask_truncated`, completions cut off by max_tokens keep their place in the statistics
  but get no gradient (DAPO overlong filtering);
- the loss denominator counts every rollout that reaches the loss (see `RolloutBatch.normalizer`).

`RolloutPipeline` refuses a batch in which too many rollouts failed in inference
(`inference_failure`): such a batch says more about a dead server than about the policy, so it is
neither banked nor trained on; `InferenceUnavailableError` stops the run, and a rerun regenerates it.
It refuses the same way a batch whose rollouts all failed in the user's code, or one that takes the
share of such failures over the last steps past `max_user_failure_frac` (`UserCodeFailures`): the
run stops with `UserCodeError`, naming the failure to fix, rather than train on what is left.
"""

from __future__ import annotations

import contextvars
import datetime
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from llmrl.agents.base import failed_in_inference, failed_in_user_code
from llmrl.agents.multi_task import WeightedMultiTask
from llmrl.algorithms.advantages import group_advantages
from llmrl.algorithms.losses import loss_normalizer
from llmrl.algorithms.shaping import soft_overlong_penalty
from llmrl.config import AlgorithmConfig
from llmrl.errors import UserCodeError
from llmrl.inference.interface import InferenceInterface, InferenceUnavailableError, run_in_new_loop
from llmrl.trainer.bank import BankedBatch, RolloutBank
from llmrl.types import GenerationArgs, RolloutGroup, TokenRollout


def unavailable_line(inference: InferenceInterface, detail: str, started: float) -> str:
    """The one line a run stops with: the server and since when (when the interface knows them)."""
    health = inference.health()
    if health.servers and health.unreachable_since is not None:
        where = (
            f"server at {health.servers[0]}"
            if len(health.servers) == 1
            else f"servers at {', '.join(health.servers)}"
        )
        problem = f"inference {where} unreachable since {_local_time(health.unreachable_since)}"
    else:
        problem = f"inference failing since {_local_time(started)}"
    return f"{problem} ({detail}); nothing from it was trained on or kept; rerun the same command to resume"


def _local_time(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")


def inference_failure(groups: Sequence[RolloutGroup], max_frac: float | None) -> str | None:
    """Why `groups` must not be trained on, or None when they may.

    Refused: more than `max_frac` of the rollouts failed in inference, or, with `max_frac` None,
    every rollout of some group did.
    """
    failed = [[failed_in_inference(r) for r in group.rollouts] for group in groups]
    count, total = sum(map(sum, failed)), sum(map(len, failed))
    if max_frac is None:
        refused = any(all(group) for group in failed)
    else:
        refused = count > max_frac * total
    if not refused:
        return None
    reason = next(r.failure_reason for g in groups for r in g.rollouts if failed_in_inference(r))
    return f"{count} of {total} rollouts failed in inference ({reason})"


class UserCodeFailures:
    """The share of rollouts that failed in the user's code over a run's last batches, and when it is
    too high to go on: every rollout of a batch, or more than `max_frac` of the last `steps` batches'
    rollouts together (None: only the former)."""

    def __init__(self, max_frac: float | None, steps: int = 3):
        self.max_frac = max_frac
        self._recent: deque[tuple[int, int, Counter[str]]] = deque(maxlen=steps)
        """Per batch: its step, its number of rollouts, and its user-code failures by `_failure_key`."""

    def stop_line(self, step: int, groups: Sequence[RolloutGroup]) -> str | None:
        """Why the run must stop before training on `groups` (the batch of `step`), or None: counts the
        batch in when it may be trained on."""
        rollouts = [r for g in groups for r in g.rollouts]
        failures = Counter(_failure_key(r) for r in rollouts if failed_in_user_code(r))
        failed = sum(failures.values())
        if rollouts and failed == len(rollouts):
            return _stop_line(f"all {failed} rollouts of step {step}", step, failures)
        self._recent.append((step, len(rollouts), failures))
        if self.max_frac is None or len(self._recent) < (self._recent.maxlen or 0):
            return None
        total = sum(size for _, size, _ in self._recent)
        in_window = sum((counts for _, _, counts in self._recent), Counter())
        failed = sum(in_window.values())
        if failed <= self.max_frac * total:
            return None
        self._recent.pop()  # not trained on: a rerun draws this batch again
        first = self._recent[0][0] if self._recent else step
        share = (
            f"{failed} of {total} rollouts of steps {first}-{step} "
            f"(more than training.max_user_failure_frac={self.max_frac})"
        )
        return _stop_line(share, step, in_window)


def _failure_key(rollout: TokenRollout) -> str:
    return f"{rollout.env_id}: {rollout.failure_reason}"


def _stop_line(share: str, step: int, failures: Counter[str]) -> str:
    (most_often, count), *_ = failures.most_common(1)
    return (
        f"user code failed in {share}; step {step} was not trained on (fix the code and rerun the same "
        f"command to resume); most often, {count} times: {most_often}"
    )


class BatchChecks:
    """Whether a batch may be trained on (`inference_failure`, `UserCodeFailures`), as the error the run
    stops with when not."""

    def __init__(
        self,
        inference: InferenceInterface,
        max_inference_failure_frac: float | None,
        max_user_failure_frac: float | None,
    ):
        self.inference = inference
        self.max_inference_failure_frac = max_inference_failure_frac
        self.user_code_failures = UserCodeFailures(max_user_failure_frac)

    def refusal(
        self, step: int, groups: Sequence[RolloutGroup], started: float
    ) -> InferenceUnavailableError | UserCodeError | None:
        """Why the batch of `step` (generation began at `started`) must not be trained on, or None."""
        failure = inference_failure(groups, self.max_inference_failure_frac)
        if failure is not None:
            return InferenceUnavailableError(
                unavailable_line(self.inference, f"batch of step {step}: {failure}", started)
            )
        stop_line = self.user_code_failures.stop_line(step, groups)
        return UserCodeError(stop_line) if stop_line is not None else None


@dataclass
class RolloutBatch:
    """The rollouts of one step that reach the loss, with one advantage each."""

    rollouts: list[TokenRollout]
    advantages: torch.Tensor
    """``[len(rollouts)]`` float32."""

    def __len__(self) -> int:
        return len(self.rollouts)

    @property
    def sequences(self) -> list[list[int]]:
        return [r.tokens for r in self.rollouts]

    @property
    def loss_masks(self) -> list[list[bool]]:
        return [r.mask for r in self.rollouts]

    @property
    def inference_logprobs(self) -> list[list[float]] | None:
        """Per token (0 off the generated tokens); None unless every rollout carries them."""
        if any(r.logprobs is None for r in self.rollouts):
            return None
        return [r.flat_logprobs for r in self.rollouts]

    def normalizer(self, indices: Sequence[int], aggregation: str, max_length: int) -> float:
        """Loss denominator of the rollouts at `indices` (`llmrl.algorithms.losses.loss_normalizer`)."""
        if not indices:
            return 0.0
        masks = pad_sequence([torch.tensor(self.rollouts[i].mask) for i in indices], batch_first=True)
        return loss_normalizer(masks, aggregation, max_length=max_length)  # type: ignore[arg-type]


def prepare_batch(
    groups: Sequence[RolloutGroup], *, group_size: int, algorithm: AlgorithmConfig, max_tokens: int
) -> tuple[RolloutBatch, torch.Tensor]:
    """The step's loss rollouts and the advantage of every rollout (in group order)."""
    for group in groups:
        if len(group.rollouts) != group_size:
            raise ValueError(
                f"group {group.group_id} has {len(group.rollouts)} rollouts, expected {group_size}"
            )
    rollouts = [r for group in groups for r in group.rollouts]
    valid = torch.tensor([r.is_valid for r in rollouts], dtype=torch.bool)
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    if algorithm.overlong_buffer is not None:
        lengths = [r.num_generated for r in rollouts]
        buffer = min(algorithm.overlong_buffer, max_tokens)
        penalty = soft_overlong_penalty(lengths, max_tokens, buffer, algorithm.overlong_penalty)
        rewards = rewards + torch.where(valid, penalty, 0.0)
    advantages = group_advantages(
        rewards,
        group_size,
        algorithm.advantage_estimator,
        valid,
        batch_std_normalize=algorithm.batch_std_normalize,
        std_scope=algorithm.advantage_std_scope,
        ddof=algorithm.advantage_std_ddof,
        eps=algorithm.advantage_eps,
    )
    # An episode of several token sequences (an agent program's calls) trains each of them with the
    # episode's advantage.
    in_loss = [
        (i, sequence)
        for i, r in enumerate(rollouts)
        if valid[i]
        for sequence in r.sequences
        if sequence.num_generated > 0 and not (algorithm.mask_truncated and sequence.truncated)
    ]
    loss_advantages = advantages[[i for i, _ in in_loss]]
    return RolloutBatch([sequence for _, sequence in in_loss], loss_advantages), advantages


def rollout_metrics(
    groups: Sequence[RolloutGroup], advantages: torch.Tensor, *, correct_threshold: float
) -> dict[str, float]:
    """Reward, pass rate, length and failure statistics of a step's rollouts, overall and per env."""
    rollouts = [r for group in groups for r in group.rollouts]
    valid = [r for r in rollouts if r.is_valid]
    metrics: dict[str, float] = {}
    by_env: dict[str, list[TokenRollout]] = defaultdict(list)
    for rollout in valid:
        by_env[rollout.env_id].append(rollout)
    for prefix, members in [("reward", valid)] + [
        (f"reward/{env}", rs) for env, rs in sorted(by_env.items())
    ]:
        rewards = torch.tensor([r.reward for r in members], dtype=torch.float64)
        metrics[f"{prefix}/mean"] = float(rewards.mean()) if members else math.nan
        metrics[f"{prefix}/std"] = float(rewards.std(unbiased=False)) if members else math.nan
        metrics[f"{prefix}/pass_rate"] = (
            float((rewards >= correct_threshold).double().mean()) if members else math.nan
        )
    for env, members in sorted(by_env.items()):  # each reward function's mean, where it applied
        components: dict[str, list[float]] = defaultdict(list)
        for rollout in members:
            for name, value in rollout.reward_components.items():
                components[name].append(value)
        metrics |= {
            f"reward/{env}/{name}": sum(values) / len(values) for name, values in sorted(components.items())
        }
    lengths = torch.tensor([r.num_generated for r in valid], dtype=torch.float64)
    metrics["rollout/response_length"] = float(lengths.mean()) if valid else math.nan
    metrics["rollout/response_length_max"] = float(lengths.max()) if valid else math.nan
    metrics["rollout/truncated_frac"] = sum(r.truncated for r in valid) / len(valid) if valid else math.nan
    metrics["rollout/placeholder_frac"] = 1.0 - len(valid) / len(rollouts) if rollouts else 0.0
    if groups:
        has_signal = advantages.view(len(groups), -1).ne(0).any(dim=1)
        metrics["rollout/zero_signal_group_frac"] = 1.0 - float(has_signal.float().mean())
    metrics["rollout/advantage_abs_mean"] = float(advantages.abs().mean()) if advantages.numel() else 0.0
    return metrics


class RolloutPipeline:
    """Generates each step's batch at most `lag` steps ahead of training, banking every batch.

    Batch ``t`` (for training step ``t``) is generated with the weights of step ``max(0, t - 1 - lag)``:
    with ``lag=0`` right after the previous step's weights are synced (on-policy); with ``lag=L`` while
    the L steps before it train. The schedule is fixed, not a race: a batch is submitted right after
    the weights it must use are synced, and a sync waits until every batch submitted before it is
    complete, so in-flight work always finishes on the weights it started with and no sequence mixes
    two versions. With a lag, batches are drawn one at a time, in step order, by a worker thread with
    its own event loop while the trainer's thread trains; without one, on the trainer's thread. A seeded run
    therefore generates the same
    tokens with or without interruptions, whatever the timing.

    With `in_flight` weight updates a sync does not wait: batches generating carry on with the new
    weights (the interface records each token's version), so a batch mixes versions and which token
    gets which depends on timing.
    """

    def __init__(
        self,
        agents: WeightedMultiTask,
        inference: InferenceInterface,
        *,
        num_groups: int,
        group_size: int,
        generation_args: Callable[[int], GenerationArgs],
        lag: int,
        last_step: int,
        bank: RolloutBank,
        max_inference_failure_frac: float | None = None,
        max_user_failure_frac: float | None = None,
        in_flight: bool = False,
    ):
        self.agents = agents
        self.in_flight = in_flight
        self.inference = inference
        self.num_groups = num_groups
        self.group_size = group_size
        self.generation_args = generation_args
        self.lag = lag
        self.last_step = last_step
        self.bank = bank
        self.checks = BatchChecks(inference, max_inference_failure_frac, max_user_failure_frac)
        # Later batches are not drawn after a refused one.
        self._refused: InferenceUnavailableError | UserCodeError | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmrl-rollouts")
        self._batches: dict[int, Future[list[RolloutGroup]] | None] = {}  # None: not drawn yet (lag 0)
        self._state_after: dict[int, dict[str, Any]] = {}  # agents' state right after drawing batch t
        self._next_step = 1

    def start(self, trained_step: int) -> int:
        """Continue after `trained_step`: banked batches first, then submit what the lag allows.

        Returns how many banked batches were taken up."""
        self._state_after[trained_step] = self.agents.state_dict()
        pending = self.bank.pending(trained_step)
        for banked in pending:
            done: Future[list[RolloutGroup]] = Future()
            done.set_result(banked.groups)
            self._batches[banked.step] = done
            self._state_after[banked.step] = banked.agent_state
        if pending:
            self.agents.load_state_dict(pending[-1].agent_state)
        self._next_step = trained_step + 1 + len(pending)
        self.submit_ahead(trained_step)
        return len(pending)

    def get(self, step: int) -> list[RolloutGroup]:
        """The groups of training step `step` (waits for their generation, or draws them with no lag)."""
        batch = self._batches.pop(step)
        return self._draw(step) if batch is None else batch.result()

    def wait_ahead(self) -> None:
        """Wait until every submitted batch is complete (before the weights they use change); with
        in-flight updates, only raise a batch already refused.

        A refused batch is raised here, before the step now training can be checkpointed: its
        rerun must start from weights no newer than those the refused batch is to be generated with
        (in flight, a batch still generating may be refused after that checkpoint, and its rerun
        generates it on newer weights).
        """
        for future in list(self._batches.values()):
            if future is not None and not self.in_flight:
                future.exception()  # waits; other failures are raised by `get`
        if self._refused is not None:
            raise self._refused

    def submit_ahead(self, trained_step: int) -> None:
        """Submit the batches the weights of `trained_step` (now served) are to generate."""
        while self._next_step <= min(trained_step + 1 + self.lag, self.last_step):
            if self.lag == 0:
                # Nothing to overlap with: `get` draws it on the trainer's thread, within the step. A
                # second thread running torch ops gets its own OpenMP team, and on a small CPU the two
                # teams slow each other down.
                self._batches[self._next_step] = None
            else:
                self._batches[self._next_step] = self._worker.submit(
                    contextvars.copy_context().run, self._draw, self._next_step
                )
            self._next_step += 1

    def agent_state(self, trained_step: int) -> dict[str, Any]:
        """The agents' state as of the batch of `trained_step` (what a checkpoint of that step saves)."""
        for step in [s for s in list(self._state_after) if s < trained_step]:
            del self._state_after[step]
        return self._state_after[trained_step]

    def pop_metrics(self) -> dict[str, float]:
        """The pipeline's own metrics since the last call: none, a batch being one step's draw."""
        return {}

    def close(self) -> None:
        for future in self._batches.values():
            if future is not None:
                future.cancel()
        self._worker.shutdown(wait=True)

    def _draw(self, step: int) -> list[RolloutGroup]:
        if self._refused is not None:  # drawn after a refused batch, this one would follow the wrong problems
            raise self._refused
        started = time.time()
        groups = run_in_new_loop(
            self.agents.group_rollouts(
                self.inference, self.num_groups, self.group_size, self.generation_args(step)
            )
        )
        self._refused = self.checks.refusal(step, groups, started)
        if self._refused is not None:
            raise self._refused
        state = self.agents.state_dict()
        self.bank.append(BankedBatch(step=step, groups=groups, agent_state=state))
        self._state_after[step] = state
        return groups


def staleness_metrics(groups: Sequence[RolloutGroup], trained_version: int) -> dict[str, float]:
    """How many weight versions behind the trained policy the step's sampled tokens were generated:
    mean and max over the tokens, and the share of tokens of each age (``rollout/token_age/K``)."""
    ages: Counter[int] = Counter()
    for rollout in (r for g in groups for r in g.rollouts if r.is_valid):
        for sequence in rollout.sequences:
            sampled = zip(sequence.token_versions, sequence.mask, strict=True)
            ages.update(trained_version - version for version, generated in sampled if generated)
    total = sum(ages.values())
    if not total:
        return {}
    metrics = {
        "rollout/staleness_mean": sum(age * count for age, count in ages.items()) / total,
        "rollout/staleness_max": float(max(ages)),
    }
    return metrics | {
        f"rollout/token_age/{age}": ages[age] / total for age in range(min(ages), max(ages) + 1)
    }
