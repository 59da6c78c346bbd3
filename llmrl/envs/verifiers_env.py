"""verifiers environments (prime-rl's library), trained as they are: their own rollouts and rubrics.

A verifiers environment (`vf.SingleTurnEnv`, `vf.MultiTurnEnv`, `vf.ToolEnv`, ... with a `vf.Rubric`)
is named by its id, as the library loads it (`vf.load_environment(env_id, **environment_args)`: an
installed environment module with a ``load_environment`` function), or as ``module:function`` of a
`plugins:` module that returns one::

    environments:
      - agent_type: verifiers
        agent_args:
          environment: my_env:load_environment     # or an installed environment's id
          environment_args: {max_turns: 3}

Each episode is an `openai_agent` episode (`llmrl.agents.openai_agent`) whose program is the
environment's own `rollout`, against the episode's client, followed by its rubric's `score_rollout`:
every chat call the environment makes is sampled through the episode's token-exact endpoint, so multi-turn
and tool environments train on exactly the tokens sampled. The rubric's reward is the episode's reward,
and each of its reward functions' values a reward component (``reward/<env>/<function>``).

The problems are the rows of the environment's dataset, and of its eval dataset when it has one (else
`eval_size` rows are held out of the dataset), drawn in an order seeded from the run's seed.

Failures are the user's code failing, at its line: an environment that raises, or ends its rollout
with an error of its own (``program``), and a reward function that raises (``reward``; the rubric
itself would log it and score 0). A completion the client rejects as empty is the model's doing: the
rubric scores what the rollout has, and the episode trains.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.util
import inspect
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

from llmrl.agents.endpoint import MODEL_NAME, EpisodeFailure
from llmrl.agents.openai_agent import EpisodeFailed, OpenAIAgent
from llmrl.errors import UserError, code_location
from llmrl.registry import resolve_function
from llmrl.rewards.functions import Reward

MISSING_EXTRA = "agent_type verifiers needs the verifiers extra: pip install 'llmrl[verifiers]'"

_SET_BY_THE_ENVIRONMENT = (
    "rollout",
    "path",
    "name",
    "split",
    "eval_split",
    "data_files",
    "eval_data_files",
    "dataset",
    "eval_dataset",
    "id_column",
)
"""`openai_agent` arguments this agent sets: the program and the problems are the environment's."""

_reward_failures: ContextVar[list[tuple[BaseException, Callable[..., Any]]]] = ContextVar(
    "llmrl_verifiers_reward_failures"
)
"""The reward functions that raised while the current episode's rubric scored it, with their errors."""


def _import_verifiers() -> Any:
    """`verifiers`, with the classic API (`vf.load_environment`, `vf.Environment`) this agent runs (0.4 has
    only `verifiers.v1`)."""
    try:
        import verifiers as vf
    except ImportError:
        raise UserError(MISSING_EXTRA) from None
    try:
        vf.load_environment  # noqa: B018 - present in the classic API only
    except AttributeError:
        raise UserError(
            f"agent_type verifiers runs verifiers' classic API, which verifiers {vf.__version__} does not have: "
            "pip install 'verifiers>=0.3.1,<0.4'"
        ) from None
    return vf


class VerifiersAgent(OpenAIAgent):
    """A verifiers environment's rollouts and rubric, run on each episode's token-exact client."""

    def __init__(self, *, environment: str, environment_args: Mapping[str, Any] | None = None, **kwargs: Any):
        """
        Args:
            environment: an installed verifiers environment's id (loaded by `vf.load_environment`), or
                ``module:function`` of a `plugins:` module, called with `environment_args`.
            environment_args: keyword arguments of the environment's ``load_environment``.
            **kwargs: `openai_agent` options (model_spec, chat_template, tool_parser, max_calls,
                max_episode_tokens, timeout_s) and `ProblemSetAgent` ones (eval_size, inference_timeout_s,
                generation_args).
        """
        own = sorted(set(kwargs) & set(_SET_BY_THE_ENVIRONMENT))
        if own:
            raise ValueError(f"{', '.join(own)}: the program and the problems are the environment's own")
        if not isinstance(environment_args, Mapping | None):
            raise ValueError(
                f"environment_args: expected a mapping of keyword arguments, got {environment_args!r}"
            )
        vf = _import_verifiers()
        self.environment, definition = _load(vf, environment, dict(environment_args or {}))
        if self.environment.requires_group_rollouts:
            raise ValueError(
                f"environment: {environment}'s rubric has group reward functions, which score a group of "
                "rollouts together; agent_type verifiers scores each episode on its own"
            )
        _record_reward_failures(self.environment.rubric)
        dataset = self.environment.build_dataset()
        if dataset is None:
            raise ValueError(f"environment: {environment} has no dataset to train on")
        super().__init__(
            rollout=self._rollout,
            dataset=dataset,
            eval_dataset=self.environment.build_eval_dataset(),
            **kwargs,
        )
        self.program_definition = definition
        self.verifiers = vf

    async def _rollout(self, client: Any, row: dict[str, Any]) -> Reward:
        """The environment's rollout of `row` on the episode's client, scored by its rubric."""
        environment = self.environment
        failures: list[tuple[BaseException, Callable[..., Any]]] = []
        _reward_failures.set(failures)  # this episode's task only: it runs in a context of its own
        sampling_args = copy.deepcopy(environment.sampling_args)
        state = await environment.rollout(
            row, self.verifiers.OpenAIChatCompletionsClient(client), MODEL_NAME, sampling_args
        )
        await environment.rubric.score_rollout(state)
        await environment.rubric.cleanup(state)
        error = state.get("error")
        if error is not None and not isinstance(error, self.verifiers.InvalidModelResponseError):
            where = code_location(error, self.program_definition)
            raise EpisodeFailed(EpisodeFailure("program", f"{where}: {_described(error)}"))
        if failures:
            error, function = failures[0]
            where = code_location(error, function)
            raise EpisodeFailed(EpisodeFailure("reward", f"{where}: {_described(error)}"))
        metrics = state.get("metrics") or {}
        return Reward(state["reward"], {str(name): float(value) for name, value in metrics.items()})


def _load(vf: Any, environment: str, arguments: dict[str, Any]) -> tuple[Any, Callable[..., Any]]:
    """The environment `environment` names, built with `arguments`, and the user's function that built it."""
    if not isinstance(environment, str) or not environment:
        raise ValueError(f"environment: expected an environment id or module:function, got {environment!r}")
    if ":" in environment:
        definition = resolve_function(environment)
        build = functools.partial(definition, **arguments)
    else:
        from verifiers.utils.env_utils import env_module_name

        module = env_module_name(environment)
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"environment: unknown verifiers environment {environment!r} (no module {module!r} is "
                "installed); install it, or name a plug-in's function as module:function"
            )
        definition = vf.load_environment
        build = functools.partial(vf.load_environment, environment, **arguments)
    try:
        with _signal_handlers_kept():
            loaded = build()
    except Exception as exc:  # noqa: BLE001 - the user's code failed: one line, at its line
        # vf.load_environment raises an error of its own, from the load function's
        cause = exc if definition is not vf.load_environment or exc.__cause__ is None else exc.__cause__
        raise ValueError(f"environment: {code_location(cause, definition)}: {_described(cause)}") from exc
    if definition is vf.load_environment:
        definition = importlib.import_module(module).load_environment
    if not isinstance(loaded, vf.Environment):
        raise ValueError(
            f"environment: {environment} returned {type(loaded).__name__}; expected a verifiers Environment"
        )
    return loaded, definition


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Keeps the process's SIGINT and SIGTERM handlers across an environment's construction: a verifiers
    Environment installs its own (tear down, then exit), which would replace llmrl's stop on a signal."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield
        return
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)


def _record_reward_failures(rubric: Any) -> None:
    """Wrap each reward function of `rubric` (and of the rubrics it groups) so that an exception it raises
    is recorded for the episode being scored, then raised on to the rubric as before."""
    for member in getattr(rubric, "rubrics", ()):
        _record_reward_failures(member)
    rubric.funcs = [_recording(function) for function in rubric.funcs]


def _recording(function: Callable[..., Any]) -> Callable[..., Any]:
    # functools.wraps keeps the name (the metric's) and, through __wrapped__, the signature the rubric
    # reads to choose the arguments.
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def scored_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await function(*args, **kwargs)
            except Exception as exc:
                _reward_failures.get([]).append((exc, function))
                raise

        return scored_async

    @functools.wraps(function)
    def scored(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            _reward_failures.get([]).append((exc, function))
            raise

    return scored


def _described(error: BaseException) -> str:
    """``Type: message``, the message taken from the first error of the chain that has one (verifiers
    raises some errors with none, from the one that has it)."""
    message = next((str(e) for e in _chain(error) if str(e)), "")
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
