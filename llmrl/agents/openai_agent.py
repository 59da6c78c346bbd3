"""Agent programs written against the `openai` client, trained as they are.

The program is one coroutine function in a `plugins:` module::

    async def rollout(client: openai.AsyncOpenAI, problem: dict) -> float:
        reply = await client.chat.completions.create(model="policy", messages=[...])
        ...
        return reward          # or {"reward": reward, "other_number": ...}

and the config names it::

    plugins: [examples/retry_agent.py]
    environments:
      - agent_type: openai_agent
        agent_args:
          rollout: retry_agent:rollout
          data_files: examples/data/sums_train.jsonl
          eval_data_files: examples/data/sums_test.jsonl

From Python (`llmrl.train`), `rollout` may be the function itself, and `dataset` / `eval_dataset`
`datasets.Dataset` objects.

Problems are the rows of `data_files` / `eval_data_files` (or a hub dataset: `path`, `split`,
`eval_split`), read as the dataset agent reads them, each passed to the program as a dict. An
episode is one run of the program on one problem; `group_size` episodes make a group. Each episode
gets its own client, whose requests reach only that episode's endpoint (`llmrl.agents.endpoint`),
in front of the run's inference interface; the endpoint records the tokens that become training
sequences, all with the episode's reward.

An episode is a placeholder (not trained on, counted in the metrics under ``failures/<stage>``)
when the program raises (``program``), returns something that is not a reward (``reward``), makes
no call, or breaks a limit (``limit``: `max_calls`, `max_episode_tokens`, `timeout_s`), and when an
inference request fails (``inference``). A failure of the program names where: the line of the
program that raised, or the program's definition (``program: my_agent.py:21 in rollout: KeyError:
'questoin'``). Training episodes refuse sampling options the trainer
cannot reproduce (penalties, `min_tokens`, temperature 0) with an HTTP 400, which the program sees
as `openai.BadRequestError`; held-out evaluation runs the same program and accepts them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai

from llmrl.agents.base import Problem, placeholder_rollout, request_args
from llmrl.agents.dataset import ProblemRows, RowProblems
from llmrl.agents.endpoint import Episode, EpisodeFailure, EpisodeLimits
from llmrl.agents.reward_only import ProblemSetAgent
from llmrl.agents.tool_parsers import TOOL_PARSERS
from llmrl.errors import UserCodeFailure, code_location
from llmrl.inference.interface import InferenceInterface
from llmrl.models.loading import load_tokenizer
from llmrl.registry import resolve_function
from llmrl.rewards.functions import Reward
from llmrl.types import GenerationArgs, RolloutGroup, TokenRollout

Program = Callable[[openai.AsyncOpenAI, dict[str, Any]], Awaitable[Any]]

_training = contextvars.ContextVar("llmrl_openai_agent_training", default=False)
"""Set while training groups are drawn: their episodes refuse options the trainer cannot follow."""


class OpenAIAgent(RowProblems, ProblemSetAgent):
    """Runs an async program that talks to the policy through an OpenAI client; it returns the reward."""

    def __init__(
        self,
        *,
        rollout: str | Program,
        model_spec: str | None = None,
        chat_template: str | None = None,
        tool_parser: str | None = None,
        max_calls: int | None = 16,
        max_episode_tokens: int | None = None,
        timeout_s: float | None = 600.0,
        path: str | None = None,
        data_files: str | list[str] | None = None,
        name: str | None = None,
        split: str = "train",
        eval_split: str | None = None,
        eval_data_files: str | list[str] | None = None,
        dataset: Any = None,
        eval_dataset: Any = None,
        id_column: str | None = None,
        **kwargs: Any,
    ):
        """
        Args:
            rollout: the program, ``module:function`` of a `plugins:` module (an ``async def``), or the
                function itself (from Python, `llmrl.train`).
            model_spec: the model whose tokenizer and chat template render the calls (default: the
                run's `model.spec`).
            chat_template: a Jinja chat template file used instead of the tokenizer's.
            tool_parser: how tool calls are read from completions (``hermes``); None refuses ``tools``.
            max_calls / max_episode_tokens / timeout_s: an episode's limits: chat calls, tokens of
                its training sequences together, seconds the program runs on its own (its model calls'
                waits for generation left out: they have `inference_timeout_s`) (None: no limit).
            path / name / split / eval_split / data_files / eval_data_files / id_column: the
                problems, as for the dataset agent (ids default to the row number).
            dataset / eval_dataset: a `datasets.Dataset` (from Python, `llmrl.train`) in place of `path` or
                `data_files`, and of `eval_split` or `eval_data_files`.
            **kwargs: `ProblemSetAgent` options (eval_size, inference_timeout_s, generation_args).
        """
        super().__init__(**kwargs)
        program = rollout if callable(rollout) else resolve_function(rollout)
        if not inspect.iscoroutinefunction(program):
            name = getattr(program, "__qualname__", rollout)
            raise ValueError(f"rollout: {name} must be an async def function (client, problem)")
        if tool_parser is not None and tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser: expected one of {sorted(TOOL_PARSERS)}, got {tool_parser!r}")
        for field, value in (("max_calls", max_calls), ("max_episode_tokens", max_episode_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{field} must be >= 1 or null, got {value}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or null, got {timeout_s}")
        rows = ProblemRows.load(
            path=path,
            data_files=data_files,
            name=name,
            split=split,
            eval_split=eval_split,
            eval_data_files=eval_data_files,
            dataset=dataset,
            eval_dataset=eval_dataset,
        )
        self.program: Program = program
        self.program_definition: Callable[..., Any] = program
        """Where a failure is located when its traceback holds no line of the user's: the program, or, for
        a subclass whose program runs a library's code, the user's code that it runs."""
        self.model_spec = model_spec
        self.chat_template = chat_template
        self.tool_parser = TOOL_PARSERS[tool_parser] if tool_parser else None
        self.limits = EpisodeLimits(max_calls=max_calls, max_tokens=max_episode_tokens)
        self.timeout_s = timeout_s
        self.id_column = id_column
        self._rows, self._eval_rows = rows.rows, rows.eval_rows
        self._sources = (rows.source, rows.eval_source)

    # ---- problems --------------------------------------------------------------------------------

    def prompt_from_row(self, row: dict[str, Any], split: str, index: int) -> str:
        """The row as JSON, for evaluation results: the program itself is given the row."""
        del split, index
        return json.dumps(row, default=str)

    # ---- episodes --------------------------------------------------------------------------------

    @functools.cached_property
    def tokenizer(self) -> Any:
        if self.model_spec is None:
            raise ValueError("model_spec: the model whose chat template renders the calls is not known")
        tokenizer = load_tokenizer(self.model_spec)
        if self.chat_template is not None:
            with open(self.chat_template, encoding="utf-8") as file:
                tokenizer.chat_template = file.read()
        return tokenizer

    def check_problems(self) -> None:
        super().check_problems()
        if self.model_spec is not None:
            self.tokenizer  # noqa: B018 - a missing tokenizer or template file fails before the run starts

    async def group_rollouts(
        self,
        inference: InferenceInterface,
        num_groups: int,
        group_size: int,
        generation_args: GenerationArgs | None = None,
    ) -> list[RolloutGroup]:
        token = _training.set(True)
        try:
            return await super().group_rollouts(inference, num_groups, group_size, generation_args)
        finally:
            _training.reset(token)

    async def run_episodes(
        self, inference: InferenceInterface, problem: Problem, n: int, args: GenerationArgs
    ) -> list[TokenRollout]:
        """`n` episodes of the program on `problem`; failures become placeholders, never exceptions."""
        episodes = (self._episode(inference, problem, request_args(args, "sample", i)) for i in range(n))
        return list(await asyncio.gather(*episodes))

    async def _episode(
        self, inference: InferenceInterface, problem: Problem, args: GenerationArgs
    ) -> TokenRollout:
        episode = Episode(
            inference,
            self.tokenizer,
            args=args,
            training=_training.get(),
            tool_parser=self.tool_parser,
            limits=self.limits,
            timeout_s=self.inference_timeout_s,
        )
        failure: EpisodeFailure | None = None
        async with httpx.AsyncClient(transport=episode.transport()) as http:
            # The base URL is a name only: the transport answers every request itself.
            client = openai.AsyncOpenAI(
                base_url="http://llmrl-episode/v1", api_key="llmrl", http_client=http, max_retries=0
            )
            try:
                result = await episode.clock.run(
                    self.program(client, dict(problem.row or {})), self.timeout_s
                )
            except TimeoutError:
                failure = EpisodeFailure("limit", f"the program ran past timeout_s={self.timeout_s} s")
            except EpisodeFailed as exc:
                failure = exc.failure
            except Exception as exc:  # noqa: BLE001 - the program's failure fails its episode only
                where = code_location(exc, self.program_definition)
                failure = EpisodeFailure("program", f"{where}: {type(exc).__name__}: {exc}")
        if episode.failure is not None:  # what the program saw as an error (and may have caught)
            failure = episode.failure
        elif failure is None and not episode.sequences:
            failure = EpisodeFailure(
                "program",
                f"{code_location(None, self.program_definition)}: made no model call that was answered, so "
                "there is nothing to train on",
            )
        if failure is None:
            try:
                value, components = _reward(result)
            except UserCodeFailure as exc:
                failure = EpisodeFailure("reward", f"{code_location(None, self.program_definition)}: {exc}")
            else:
                return episode.rollout(self.env_id, problem.id, value, components)
        self._count_failure(failure.stage, failure.reason, count=1)
        return placeholder_rollout(self.env_id, problem.id, failure.reason)


class EpisodeFailed(Exception):
    """Raised by a program that runs a library's code for the user (a verifiers environment's rollout
    and rubric), which knows the stage that failed and the user's line: the episode fails with exactly
    that."""

    def __init__(self, failure: EpisodeFailure):
        super().__init__(failure.reason)
        self.failure = failure


def _reward(result: Any) -> tuple[float, dict[str, float]]:
    """The reward and the other numbers to log from a program's result: a number or a dict (raises
    `UserCodeFailure`, without a location, for anything else)."""
    if isinstance(result, Reward):
        if not _is_number(result.value):
            raise UserCodeFailure.returned(None, result, "a finite reward")
        return result.value, dict(result.components)
    if isinstance(result, dict):
        if "reward" not in result:
            raise UserCodeFailure.returned(None, result, "a dict with 'reward'")
        numbers = {str(k): v for k, v in result.items() if k != "reward"}
        bad = [k for k, v in numbers.items() if not _is_number(v)]
        if bad or not _is_number(result["reward"]):
            raise UserCodeFailure.returned(None, result, "finite numbers as its values")
        return float(result["reward"]), {k: float(v) for k, v in numbers.items()}
    if not _is_number(result):
        raise UserCodeFailure.returned(None, result, "a finite number or a dict with 'reward'")
    return float(result), {}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
