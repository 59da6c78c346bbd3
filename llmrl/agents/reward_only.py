"""Reward-only agents: a problem set and a reward function, single- or multi-turn.

`ProblemSetAgent` holds what does not depend on how an episode runs: problems are split once into
a fixed held-out evaluation set and a training set, training problems are drawn by a seeded
`EpochSampler` (no repeats within an epoch, resumable) into groups, and failures are counted. A
subclass gives `prompts()` and `run_episodes(...)`, which samples one problem's episodes;
`RewardOnlyAgent` runs them as requests to the inference interface, and agent programs
(`llmrl.agents.openai_agent`) as a program that returns its own reward.

A `RewardOnlyAgent` subclass gives `prompts()` (the problems) and `reward(response, problem)`; for
multi-turn environments also `observe(turn, response, problem)`, which returns the next user
message or None to stop. Everything else is done here:

* all requests of a call are issued at once (`asyncio.gather`), one request with ``n=group_size``
  per group, so the engine batches them and shares each prompt's prefill;
* a multi-turn episode is continued at the token level: the next request carries the exact ids
  so far in `prompt_token_ids`, so earlier turns are never re-tokenised, and only the model's own
  tokens are marked in the generation mask;
* a seeded request (`GenerationArgs.seed`) is split into one seed per request, derived from the
  environment, group or problem, sample and turn (`request_args`), so seeded runs sample the same
  tokens however the requests interleave;
* failures are isolated: an exception or a timeout in inference, `observe` or `reward` (or a reward
  that is not a finite number) turns the affected rollouts into placeholders
  (`status="placeholder"`, `failure_reason`), counted in `pop_metrics()` (those of
  `group_rollouts`; an evaluation's results count its own), while the rest of the group and batch
  go on. The reason of a failure in `observe` or `reward` names the file and line of the user's code
  (`llmrl.errors.code_location`); each distinct reason is logged once per call of `group_rollouts`
  or `evaluate`, with its count. A request the inference refuses for what it holds
  (`RequestRejected`: too long for the context) fails as the problem's data (``data:``), not the
  inference; problems whose first prompt cannot fit are left out before training
  (`drop_overlong_prompts`).

Rewards and observations run in worker threads (`reward_concurrency` at a time) under
`reward_timeout_s`, so that they never block generation on the event loop; a function that never
returns leaks its thread but not the run. Coroutine functions are awaited directly. A problem's
episodes are scored together once all of them are done (`score_episodes`): one call per episode by
default, one per group for reward functions written for TRL (`DatasetAgent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import random
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from llmrl.agents.base import (
    DATA_FAILURE,
    Agent,
    Problem,
    PromptRoom,
    log_placeholders,
    placeholder_rollout,
    placeholders_logged_once,
    prompt_text,
    request_args,
)
from llmrl.agents.sampler import EpochSampler
from llmrl.agents.trajectory import Trajectory
from llmrl.agents.workers import in_worker_thread
from llmrl.errors import UserCodeFailure, UserError, code_location
from llmrl.inference.interface import InferenceInterface, RequestRejected
from llmrl.rewards.functions import Reward, finite_number
from llmrl.telemetry import trace_span
from llmrl.types import (
    ChatMessage,
    EvaluationResponse,
    EvaluationResult,
    GenerationArgs,
    InferenceRequest,
    InferenceResponse,
    RolloutGroup,
    TokenRollout,
    validation_problems,
)

log = logging.getLogger(__name__)

# The held-out split must not move when the run seed changes, or evaluations of different seeds
# would not be comparable; it depends only on the problem list.
_HELD_OUT_SEED = "llmrl-held-out"

_evaluating: contextvars.ContextVar[bool] = contextvars.ContextVar("llmrl_evaluating", default=False)
"""True within `ProblemSetAgent.evaluate`: the failures there are the evaluation's, counted in its
results (``failed_samples``), not in `pop_metrics`, which counts the training steps' (step 1's would
otherwise hold the starting evaluation's). A context variable, so that training draws generating
meanwhile (ahead, on their own thread) keep counting theirs."""


@contextlib.contextmanager
def _counted_by_the_evaluation() -> Iterator[None]:
    token = _evaluating.set(True)
    try:
        yield
    finally:
        _evaluating.reset(token)


class ProblemSetAgent(Agent):
    """Base of environments defined by a problem list: splits, problem order, groups, evaluation and
    failure counters; a subclass says how one problem's episodes run (`run_episodes`)."""

    def __init__(
        self,
        *,
        env_id: str | None = None,
        seed: int = 0,
        eval_size: int = 64,
        inference_timeout_s: float | None = 600.0,
        generation_args: dict[str, Any] | GenerationArgs | None = None,
    ):
        """
        Args:
            env_id: name in rollouts, metrics and logs (default: the class name).
            seed: seed of the training problem order.
            eval_size: problems held out for evaluation when `eval_prompts()` gives none.
            inference_timeout_s: limit of one inference request (None = no limit).
            generation_args: sampling fields this environment sets over the caller's (e.g. max_tokens).
        """
        if eval_size < 0:
            raise ValueError(f"eval_size must be >= 0, got {eval_size}")
        if inference_timeout_s is not None and inference_timeout_s <= 0:
            raise ValueError(f"inference_timeout_s must be > 0 or null, got {inference_timeout_s}")
        self.env_id = env_id or type(self).__name__
        self.seed = seed
        self.eval_size = eval_size
        self.inference_timeout_s = inference_timeout_s
        try:
            self.generation_args = GenerationArgs.model_validate(generation_args or {})
        except ValidationError as exc:
            raise ValueError(validation_problems(exc.errors(), prefix="generation_args.")) from None
        self._counters: Counter[str] = Counter()
        self._groups_drawn = 0

    # ---- what a subclass provides -------------------------------------------------------------

    @abstractmethod
    def prompts(self) -> Sequence[Problem]:
        """All problems (training ones, plus the held-out ones unless `eval_prompts` gives them)."""

    def eval_prompts(self) -> Sequence[Problem] | None:
        """A separate evaluation set; None carves `eval_size` problems out of `prompts()`."""
        return None

    @abstractmethod
    async def run_episodes(
        self, inference: InferenceInterface, problem: Problem, n: int, args: GenerationArgs
    ) -> list[TokenRollout]:
        """`n` finished episodes of `problem`; failures become placeholders, never exceptions."""

    # ---- problem splits -------------------------------------------------------------------------

    @functools.cached_property
    def _splits(self) -> tuple[list[Problem], list[Problem]]:
        problems = list(self.prompts())
        held_out = self.eval_prompts()
        for name, items in (("prompts()", problems), ("eval_prompts()", held_out or [])):
            repeated = sorted(i for i, count in Counter(p.id for p in items).items() if count > 1)
            if repeated:
                raise ValueError(f"{self.env_id}: {name} has repeated problem ids, e.g. {repeated[:5]}")
        if held_out is not None:
            train, evaluation = problems, list(held_out)
        else:
            if len(problems) <= self.eval_size:
                raise ValueError(
                    f"{self.env_id}: eval_size={self.eval_size} leaves no training problems out of "
                    f"{len(problems)}; lower eval_size or give a separate evaluation set"
                )
            order = list(range(len(problems)))
            random.Random(_HELD_OUT_SEED).shuffle(order)
            chosen = set(order[: self.eval_size])
            evaluation = [p for i, p in enumerate(problems) if i in chosen]
            train = [p for i, p in enumerate(problems) if i not in chosen]
        if not train:
            raise ValueError(f"{self.env_id}: no training problems")
        return train, evaluation

    def check_problems(self) -> None:
        self._splits  # noqa: B018 - loads and checks both splits

    @property
    def train_problems(self) -> list[Problem]:
        return self._splits[0]

    @property
    def eval_problems(self) -> list[Problem]:
        return self._splits[1]

    @functools.cached_property
    def _sampler(self) -> EpochSampler:
        return EpochSampler(len(self.train_problems), seed=self.seed)

    # ---- the Agent contract ----------------------------------------------------------------------

    async def group_rollouts(
        self,
        inference: InferenceInterface,
        num_groups: int,
        group_size: int,
        generation_args: GenerationArgs | None = None,
    ) -> list[RolloutGroup]:
        if num_groups < 0 or group_size < 1:
            raise ValueError(f"need num_groups >= 0 and group_size >= 1, got {num_groups} and {group_size}")
        args = self._sampling_args(generation_args)
        problems = [self.train_problems[i] for i in self._sampler.take(num_groups)]
        first = self._groups_drawn
        self._groups_drawn += num_groups
        with placeholders_logged_once("this step"):
            samples = await asyncio.gather(
                *(
                    self.run_episodes(
                        inference, p, group_size, request_args(args, self.env_id, "train", first + i)
                    )
                    for i, p in enumerate(problems)
                )
            )
        return [
            RolloutGroup(group_id=f"{self.env_id}/{first + i}", rollouts=rollouts)
            for i, rollouts in enumerate(samples)
        ]

    async def evaluate(
        self,
        inference: InferenceInterface,
        num_prompts: int,
        *,
        samples_per_prompt: int = 1,
        greedy: bool = False,
        generation_args: GenerationArgs | None = None,
    ) -> EvaluationResponse:
        if num_prompts < 1 or samples_per_prompt < 1:
            raise ValueError(
                f"need num_prompts >= 1 and samples_per_prompt >= 1, got {num_prompts} and {samples_per_prompt}"
            )
        args = self._sampling_args(generation_args)
        greedy_args = args.model_copy(update={"temperature": 0.0})

        async def evaluate_one(problem: Problem) -> EvaluationResult:
            requests = [
                self.run_episodes(
                    inference,
                    problem,
                    samples_per_prompt,
                    request_args(args, self.env_id, "eval", problem.id),
                )
            ]
            if greedy:
                requests.append(
                    self.run_episodes(
                        inference, problem, 1, request_args(greedy_args, self.env_id, "greedy", problem.id)
                    )
                )
            sampled, *greedy_sample = await asyncio.gather(*requests)
            # A failed sample is not a wrong answer: it is counted, not scored.
            scored = [r for r in sampled if r.is_valid]
            best = greedy_sample[0][0] if greedy_sample and greedy_sample[0][0].is_valid else None
            return EvaluationResult(
                problem_id=problem.id,
                prompt=problem.prompt,
                completions=[_completion_text(r) for r in scored],
                rewards=[r.reward for r in scored],
                greedy_completion=_completion_text(best) if best else None,
                greedy_reward=best.reward if best else None,
                failed=len(sampled) - len(scored) + len(greedy_sample) - (best is not None),
            )

        with placeholders_logged_once("in evaluation"), _counted_by_the_evaluation():
            results = await asyncio.gather(*(evaluate_one(p) for p in self.eval_problems[:num_prompts]))
        return EvaluationResponse(env_id=self.env_id, results=list(results))

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self._sampler.state_dict(), "groups_drawn": self._groups_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sampler.load_state_dict(state["sampler"])
        self._groups_drawn = state["groups_drawn"]

    def pop_metrics(self) -> dict[str, float]:
        metrics = {key: float(count) for key, count in self._counters.items()}
        self._counters.clear()
        return metrics

    def _sampling_args(self, caller: GenerationArgs | None) -> GenerationArgs:
        return (caller or GenerationArgs()).merge(self.generation_args)

    def _count_failure(self, stage: str, reason: str, *, count: int) -> None:
        """Count and log `count` rollouts replaced by placeholders for `reason` (in an evaluation: log
        them; its results count them)."""
        if not _evaluating.get():
            self._counters[f"failures/{stage}"] += 1
            self._counters["placeholders"] += count
        log_placeholders(self.env_id, reason, count)


@dataclass(frozen=True)
class _Episode:
    """An episode whose turns are done, waiting for its group's rewards."""

    trajectory: Trajectory
    response: InferenceResponse
    """Its last model turn, the one scored."""


class RewardOnlyAgent(ProblemSetAgent):
    """Base of environments defined by a problem list and a reward (optionally multi-turn)."""

    def __init__(
        self,
        *,
        max_turns: int = 1,
        reward_timeout_s: float = 60.0,
        reward_concurrency: int = 8,
        **kwargs: Any,
    ):
        """
        Args:
            max_turns: most model turns per episode (1 = single-turn).
            reward_timeout_s: limit of one `reward` or `observe` call (of a reward function: one call,
                for a group or a completion).
            reward_concurrency: calls of `reward`, `observe` or reward functions running at once.
            **kwargs: `ProblemSetAgent` options (env_id, seed, eval_size, inference_timeout_s,
                generation_args).
        """
        super().__init__(**kwargs)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if reward_timeout_s <= 0:
            raise ValueError(f"reward_timeout_s must be > 0, got {reward_timeout_s}")
        if reward_concurrency < 1:
            raise ValueError(f"reward_concurrency must be >= 1, got {reward_concurrency}")
        self.max_turns = max_turns
        self.reward_timeout_s = reward_timeout_s
        self.reward_concurrency = reward_concurrency
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    # ---- what a subclass provides -------------------------------------------------------------

    @abstractmethod
    def reward(self, response: InferenceResponse, problem: Problem) -> float | Reward:
        """Score of the episode's last model turn (a `Reward` also names its parts, for the logs)."""

    def observe(self, turn: int, response: InferenceResponse, problem: Problem) -> str | None:
        """The user's reply to model turn `turn` (0-based), or None to end the episode."""
        del turn, response, problem
        return None

    # ---- problems that cannot fit ----------------------------------------------------------------

    def drop_overlong_prompts(self, room: PromptRoom, generation_args: GenerationArgs) -> None:
        if "_sampler" in self.__dict__:
            raise RuntimeError("drop_overlong_prompts comes before any problem is drawn or restored")
        args = self._sampling_args(generation_args)
        max_tokens = args.max_tokens
        limit = room.context - max_tokens
        if limit < 1:
            raise UserError(
                f"{self.env_id}: max_tokens={max_tokens} completion tokens leave no room for a prompt in the "
                f"model's context of {room.context} tokens"
            )
        train, evaluation = self._splits
        try:
            over = [room.overlong([p.prompt for p in split], args, limit) for split in (train, evaluation)]
        except RequestRejected as exc:  # e.g. chat messages for a tokenizer without a chat template
            raise UserError(f"{self.env_id}: {exc}") from None
        if not any(over):
            return
        dropped = [
            (split[i], count)
            for split, counts in zip((train, evaluation), over, strict=True)
            for i, count in counts.items()
        ]
        longest, longest_count = max(dropped, key=lambda item: item[1])
        shown = ", ".join(problem.id for problem, _ in dropped[:5]) + (", ..." if len(dropped) > 5 else "")
        line = (
            f"{self.env_id}: {len(over[0])} of {len(train)} training and {len(over[1])} of {len(evaluation)} "
            f"evaluation problems have a prompt longer than the {limit} tokens that the model's context of "
            f"{room.context} leaves beside max_tokens={max_tokens}: {shown}; the longest, "
            f"{longest.described()}, has {longest_count} tokens"
        )
        if room.refuse:
            raise UserError(
                f"{line}; shorten or remove them, or set training.overlong_prompts: skip to train without them"
            )
        kept_train = [p for i, p in enumerate(train) if i not in over[0]]
        if not kept_train:
            raise UserError(f"{line}; no training problem is left")
        log.warning("%s; skipped (training.overlong_prompts: skip)", line)
        self._splits = (kept_train, [p for i, p in enumerate(evaluation) if i not in over[1]])

    # ---- one problem, n samples ------------------------------------------------------------------

    async def run_episodes(
        self, inference: InferenceInterface, problem: Problem, n: int, args: GenerationArgs
    ) -> list[TokenRollout]:
        """One request for `n` completions of `problem`, each continued (multi-turn); the episodes are
        scored together once all are done (`score_episodes`)."""
        try:
            responses = await self._generate(
                inference, InferenceRequest(prompt=problem.prompt, generation_args=args, n=n)
            )
        except Exception as exc:
            reason = self._record_failure("inference", exc, count=n, problem=problem)
            return [placeholder_rollout(self.env_id, problem.id, reason) for _ in range(n)]
        played = await asyncio.gather(
            *(
                self._play_episode(inference, problem, r, request_args(args, "sample", i))
                for i, r in enumerate(responses)
            )
        )
        finished = [episode for episode in played if isinstance(episode, _Episode)]
        scored = (
            await self.score_episodes([e.response for e in finished], problem, inference) if finished else []
        )
        rewards = iter(scored)
        return [
            self._scored(episode, next(rewards), problem) if isinstance(episode, _Episode) else episode
            for episode in played
        ]

    async def score_episodes(
        self, responses: list[InferenceResponse], problem: Problem, inference: InferenceInterface | None
    ) -> list[float | Reward | BaseException]:
        """The rewards of one problem's finished episodes, each from its last model turn, in order; an
        exception in place of a reward fails that rollout only. This default calls `reward` on each
        (`reward_concurrency` at a time, each under `reward_timeout_s`); an agent that scores a group in
        one call overrides it (`DatasetAgent` with reward functions, which may ask the policy's
        `inference` to judge)."""
        del inference
        return await asyncio.gather(
            *(self._call_env(self.reward, response, problem) for response in responses),
            return_exceptions=True,
        )

    async def _generate(
        self, inference: InferenceInterface, request: InferenceRequest
    ) -> list[InferenceResponse]:
        with trace_span("generate", env=self.env_id, n=request.n):
            responses = await asyncio.wait_for(inference.agenerate(request), self.inference_timeout_s)
        if len(responses) != request.n:
            raise RuntimeError(f"asked for {request.n} completions, got {len(responses)}")
        return responses

    async def _play_episode(
        self,
        inference: InferenceInterface,
        problem: Problem,
        response: InferenceResponse,
        args: GenerationArgs,
    ) -> _Episode | TokenRollout:
        """Continue the episode from its first model turn (multi-turn); a placeholder if that fails."""
        trajectory = Trajectory(args)
        trajectory.add_context(response.prompt_token_ids, prompt_text(problem.prompt))
        trajectory.add_completion(response)
        stage = "observe"
        try:
            for turn in range(self.max_turns - 1):
                message = await self._call_env(self.observe, turn, response, problem)
                if message is None:
                    break
                if not isinstance(message, str):
                    raise UserCodeFailure.returned(
                        code_location(None, self.observe), message, "a string (the next user message) or None"
                    )
                stage = "inference"
                follow_up = (
                    message
                    if isinstance(problem.prompt, str)
                    else [ChatMessage(role="user", content=message)]
                )
                prefix = list(trajectory.tokens)
                request = InferenceRequest(
                    prompt=follow_up,
                    prompt_token_ids=prefix,
                    generation_args=request_args(args, "turn", turn),
                    n=1,
                )
                (response,) = await self._generate(inference, request)
                if response.prompt_token_ids[: len(prefix)] != prefix:
                    raise RuntimeError(
                        "the inference engine did not continue from prompt_token_ids (earlier turns changed)"
                    )
                trajectory.add_context(response.prompt_token_ids[len(prefix) :], message)
                trajectory.add_completion(response)
                stage = "observe"
        except Exception as exc:
            reason = self._record_failure(stage, exc, count=1, problem=problem)
            return placeholder_rollout(self.env_id, problem.id, reason)
        return _Episode(trajectory, response)

    def _scored(
        self, episode: _Episode, reward: float | Reward | BaseException, problem: Problem
    ) -> TokenRollout:
        """The episode's rollout with its reward, or a placeholder if scoring failed."""
        try:
            if isinstance(reward, BaseException):
                raise reward
            value = finite_number(reward.value if isinstance(reward, Reward) else reward)
            if value is None:
                raise UserCodeFailure.returned(
                    code_location(None, self.reward), reward, "a finite number or a Reward"
                )
            components = reward.components if isinstance(reward, Reward) else {}
            return episode.trajectory.rollout(self.env_id, problem.id, value, components)
        except Exception as exc:
            reason = self._record_failure("reward", exc, count=1, problem=problem)
            return placeholder_rollout(self.env_id, problem.id, reason)

    def _reward_slots(self) -> asyncio.Semaphore:
        # A semaphore belongs to one event loop; the sync entry points start a new loop per call.
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(self.reward_concurrency), loop
        return self._slots

    async def _call_env(self, fn: Callable[..., Any], *args: Any, span: str | None = None) -> Any:
        """`fn(*args)`: awaited, or in a worker thread, under the concurrency limit and the timeout, as a
        trace span named `span` (default: the function's name; its time is logged as ``time/<span>_s``)."""
        async with self._reward_slots():
            with trace_span(span or fn.__name__, env=self.env_id):
                call = fn(*args) if inspect.iscoroutinefunction(fn) else in_worker_thread(fn, *args)
                return await asyncio.wait_for(call, self.reward_timeout_s)

    def _record_failure(self, stage: str, exc: BaseException, *, count: int, problem: Problem) -> str:
        """Count and log a failure of `stage` in `problem`'s episodes; returns the placeholders'
        `failure_reason`. A request the inference refused for what it holds is the problem's data
        failing (`DATA_FAILURE`), not the inference."""
        if stage == "inference" and isinstance(exc, RequestRejected):
            stage = DATA_FAILURE
            reason = f"{stage}: problem {problem.id}: {exc}"[:500]
        elif isinstance(exc, asyncio.TimeoutError | TimeoutError):
            limit = self.inference_timeout_s if stage == "inference" else self.reward_timeout_s
            reason = f"{stage}: timed out after {limit} s"
        elif isinstance(exc, UserCodeFailure):
            reason = f"{stage}: {exc}"[:500]
        elif stage in ("reward", "observe"):  # the user's code raised: where, then what
            where = code_location(exc, self.reward if stage == "reward" else self.observe)
            reason = f"{stage}: {where}: {type(exc).__name__}: {exc}"[:500]
        else:
            reason = f"{stage}: {type(exc).__name__}: {exc}"[:500]
        self._count_failure(stage, reason, count=count)
        return reason


def _completion_text(rollout: TokenRollout) -> str:
    """Everything after the prompt (all turns), or '' for a placeholder."""
    return "".join(rollout.text[1:]) if rollout.text else ""
