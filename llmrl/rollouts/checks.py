"""Whether a batch may be trained on, and the one line a run stops with when not.

A batch in which too many rollouts failed in inference (`inference_failure`) says more about a dead
server than about the policy: it is neither banked nor trained on; `InferenceUnavailableError` stops
the run, and a rerun regenerates it. So does one in which too many rollouts could not reach their
agent's environment server (`unreachable_environment`: `EnvironmentUnavailableError`), counted apart
against the same `max_inference_failure_frac`, so that the line names the server that died. A batch
whose rollouts all failed in the user's code, or one that takes the share of such failures over the
last steps past `max_user_failure_frac` (`UserCodeFailures`), is refused the same way: the run stops
with `UserCodeError`, naming the failure to fix, rather than train on what is left. Rollouts whose
request the inference refused for their data (`data:` failures) only leave their problems out, unless
every rollout of a batch failed so (`data_failure`).
"""

from __future__ import annotations

import datetime
from collections import Counter, deque
from collections.abc import Callable, Sequence

from llmrl.agents.base import (
    UNREACHABLE_FAILURE,
    failed_for_data,
    failed_in_inference,
    failed_in_user_code,
    failed_unreachable,
)
from llmrl.errors import EnvironmentUnavailableError, ServerUnavailableError, UserCodeError, UserError
from llmrl.inference.interface import InferenceInterface, InferenceUnavailableError
from llmrl.types import RolloutGroup, TokenRollout


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
    refused = _too_many(groups, max_frac, failed_in_inference)
    if refused is None:
        return None
    count, total, first = refused
    return f"{count} of {total} rollouts failed in inference ({first.failure_reason})"


def unreachable_environment(step: int, groups: Sequence[RolloutGroup], max_frac: float | None) -> str | None:
    """The line the run stops with when too many of `groups` (the batch of `step`) could not reach
    their agent's environment server, as `inference_failure` counts them; None when they may be
    trained on. It names the agent and the server, since when and why (the first such rollout's)."""
    refused = _too_many(groups, max_frac, failed_unreachable)
    if refused is None:
        return None
    count, total, first = refused
    server = (first.failure_reason or "").removeprefix(f"{UNREACHABLE_FAILURE}:").strip()
    return (
        f"{first.env_id}: {server} (batch of step {step}: {count} of {total} rollouts could not reach "
        "it); nothing from it was trained on or kept; rerun the same command to resume"
    )


def _too_many(
    groups: Sequence[RolloutGroup], max_frac: float | None, failed: Callable[[TokenRollout], bool]
) -> tuple[int, int, TokenRollout] | None:
    """(how many, of how many, the first) of `groups`' rollouts that `failed`, when more than
    `max_frac` of them did or, with `max_frac` None, every rollout of some group did; else None."""
    marks = [[failed(r) for r in group.rollouts] for group in groups]
    count, total = sum(map(sum, marks)), sum(map(len, marks))
    refused = any(all(group) for group in marks) if max_frac is None else count > max_frac * total
    if not refused:
        return None
    first = next(r for g in groups for r in g.rollouts if failed(r))
    return count, total, first


def data_failure(step: int, groups: Sequence[RolloutGroup]) -> str | None:
    """Why the batch of `step` cannot be trained on for its data, or None: every rollout's request was
    refused for what it holds (a later turn longer than the context, a server with a shorter one).
    Fewer such failures only leave their problems out of the batch."""
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts or not all(failed_for_data(r) for r in rollouts):
        return None
    (most_often, count), *_ = Counter(r.failure_reason for r in rollouts).most_common(1)
    return (
        f"every one of the {len(rollouts)} rollouts of step {step} was refused by the inference for its "
        f"data, so nothing is left to train on; most often, {count} times: {most_often}"
    )


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
    """Whether a batch may be trained on (`inference_failure`, `unreachable_environment`,
    `UserCodeFailures`), as the error the run stops with when not."""

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
    ) -> ServerUnavailableError | UserError | None:
        """Why the batch of `step` (generation began at `started`) must not be trained on, or None."""
        failure = inference_failure(groups, self.max_inference_failure_frac)
        if failure is not None:
            return InferenceUnavailableError(
                unavailable_line(self.inference, f"batch of step {step}: {failure}", started)
            )
        environment_line = unreachable_environment(step, groups, self.max_inference_failure_frac)
        if environment_line is not None:
            return EnvironmentUnavailableError(environment_line)
        data_line = data_failure(step, groups)
        if data_line is not None:
            return UserError(data_line)
        stop_line = self.user_code_failures.stop_line(step, groups)
        return UserCodeError(stop_line) if stop_line is not None else None
