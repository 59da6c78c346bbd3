"""Reward functions written as plain Python for TRL or verl, listed in an environment's config.

Two calling conventions are accepted, told apart by the function's parameters (or by ``style:``):

* **TRL**: ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``, called as
  TRL's `GRPOTrainer` calls it: keyword arguments only, one list entry per sample, the data row's
  other columns as lists too (``solution=[...]``). With a conversational dataset the prompts are
  message lists and each completion is ``[{"role": "assistant", "content": text}]``. ``None`` means
  "this function does not apply to this sample": it is left out of the weighted sum and of the
  function's mean, as in TRL. A NaN is refused: TRL's documented spelling of "not scored" is None,
  and a NaN is most often arithmetic gone wrong (0/0). A function without ``**kwargs`` gets only the
  columns it names.
* **verl**: ``fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``; a
  dict's ``score`` is the reward and its other numeric entries are logged.

A TRL-style function is called once per group: all of a prompt's completions (``group_size`` of
them in training, every sample of a problem in evaluation) in one call, as TRL lays a batch out (the
prompt repeated once per completion). ``batch: completion`` calls it once per completion instead;
verl-style functions score one sample by nature and are always called so. The agent runs the calls
(`Caller`): ``async def`` functions are awaited, concurrently across groups, and synchronous ones run
in worker threads, so that scoring never blocks generation. The functions of one group are called
concurrently. The reward is ``sum(weight * value)`` over the functions that apply; each value is
also reported under the function's name (`Reward.components`), and so logged as
``reward/<env>/<name>``. A completion no function applies to (all returned None) has no reward: it
fails like a function that raises, rather than scoring 0.

A call that raises, or returns something other than a list with one value per completion, fails
every completion of the call with a `UserCodeFailure`, whose message starts with the file and line to
fix: the function's own frame where it raised, else its definition (``my_rewards.py:12 in accuracy:
returned 1.0; expected a list with one value per completion (8)``). A value that is not a finite
number (a string, NaN, inf) fails that completion only.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from llmrl.errors import UserCodeFailure, code_location
from llmrl.registry import resolve_function
from llmrl.types import InferenceRequest, InferenceResponse

Style = Literal["trl", "verl"]
STYLES: tuple[str, ...] = ("trl", "verl")
Batch = Literal["group", "completion"]
BATCHES: tuple[str, ...] = ("group", "completion")
ENTRY_KEYS: tuple[str, ...] = ("function", "weight", "style", "name", "batch")
_TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")
_RESERVED_NAMES = ("mean", "std", "pass_rate")
"""Metric names `rollout_metrics` already logs under ``reward/<env>/``."""

Score = tuple[float | None, dict[str, float]]
"""A function's value for one completion (None: it does not apply) and the extra values it reports."""

Caller = Callable[..., Awaitable[Any]]
"""How the agent runs the user's code: ``await call(fn, *args)`` awaits a coroutine function and runs
any other in a worker thread (`RewardOnlyAgent`: ``reward_concurrency`` calls at a time, each under
``reward_timeout_s``)."""


class PolicyInference(Protocol):
    """The policy's inference interface, as a reward that asks the policy itself (an LLM judge) sees it."""

    async def agenerate(self, request: InferenceRequest) -> list[InferenceResponse]: ...


@dataclass(frozen=True)
class Sample:
    """What a reward function sees of one rollout."""

    prompt: str | list[dict[str, str]]
    """The prompt as sent: text, or chat messages as ``{role, content}`` dicts."""
    completion: str
    completion_ids: list[int]
    ground_truth: Any = None
    data_source: str | None = None
    extra_info: Any = None
    columns: Mapping[str, Any] = field(default_factory=dict)
    """The data row's other columns (TRL passes them as keyword arguments)."""


@dataclass(frozen=True)
class Reward:
    """A reward with its named parts (each reward function's value, and what verl-style ones report)."""

    value: float
    components: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardFunction:
    """One entry of an environment's ``reward_functions``."""

    function: Callable[..., Any]
    name: str
    weight: float = 1.0
    style: Style = "trl"
    batch: Batch = "group"

    def __post_init__(self) -> None:
        assert self.style != "verl" or self.batch == "completion", "verl-style functions score one sample"

    @classmethod
    def from_config(cls, entry: Mapping[str, Any] | Callable[..., Any], where: str) -> RewardFunction:
        """An entry ``{function, weight, style, name, batch}`` (or a bare callable); `where` prefixes
        errors.

        ``function`` is ``"module:name"`` for a module the config lists in ``plugins:``, or the name
        of a built-in scorer of `llmrl.rewards` (``default_compute_score``, ``math_dapo``, ...), or the
        function itself in a config built in Python (`llmrl.train`).
        """
        if callable(entry):
            entry = {"function": entry}
        if not isinstance(entry, Mapping):
            raise ValueError(
                f"{where}: expected a mapping with `function` (and `weight`, `style`, `name`, `batch`), "
                f"got {entry!r}"
            )
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; valid keys: {', '.join(ENTRY_KEYS)}")
        spec = entry.get("function")
        if spec is None:
            raise ValueError(f"{where}.function: required (e.g. my_rewards:accuracy)")
        try:
            function = spec if callable(spec) else resolve_function(spec)
        except ValueError as exc:
            raise ValueError(f"{where}.function: {exc}") from None
        style = entry.get("style") or _style_of(function, where)
        if style not in STYLES:
            raise ValueError(f"{where}.style: expected one of {list(STYLES)}, got {style!r}")
        batch = entry.get("batch") or ("completion" if style == "verl" else "group")
        if batch not in BATCHES:
            raise ValueError(f"{where}.batch: expected one of {list(BATCHES)}, got {batch!r}")
        if style == "verl" and batch != "completion":
            raise ValueError(f"{where}.batch: verl-style functions score one completion per call")
        return cls.named(function, entry, where, style=style, batch=batch)

    @classmethod
    def named(
        cls, function: Callable[..., Any], entry: Mapping[str, Any], where: str, **fields: Any
    ) -> RewardFunction:
        """`function` with the `weight` and `name` of `entry` (checked; the name defaults to the
        function's)."""
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ValueError(f"{where}.weight: expected a finite number, got {weight!r}")
        name = str(entry.get("name") or getattr(function, "__name__", "reward"))
        if name in _RESERVED_NAMES or "/" in name:
            raise ValueError(
                f"{where}.name: {name!r} is taken by a reward metric or has a '/'; set another name"
            )
        return cls(function=function, name=name, weight=float(weight), **fields)

    def check_columns(self, columns: list[str], where: str) -> None:
        """A TRL-style function must not require a column the data lacks (checked before training)."""
        if self.style != "trl":
            return
        required = [
            p.name
            for p in _parameters(self.function)
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in _TRL_ARGUMENTS
        ]
        missing = [name for name in required if name not in columns]
        if missing:
            raise ValueError(
                f"{where}: {self.name} needs the column(s) {missing}, which the data lacks; its columns are {columns}"
            )

    @property
    def location(self) -> str | None:
        """Where the function is defined (``my_rewards.py:12 in accuracy``): what a failure for what it
        returned points at."""
        return code_location(None, self.function)

    @property
    def is_async(self) -> bool:
        """Whether calling the function gives a coroutine (an ``async def`` function or ``__call__``)."""
        return inspect.iscoroutinefunction(self.function) or inspect.iscoroutinefunction(
            type(self.function).__call__
        )

    async def score_group(
        self, samples: Sequence[Sample], call: Caller, policy: PolicyInference | None = None
    ) -> list[Score | Exception]:
        """This function's scores of one group's samples, in order: one call with all of them, or one per
        sample (``batch: completion``, verl style), each run by `call`. A failure (`UserCodeFailure`, a
        timeout) stands in place of the score of each sample it failed. `policy`: the inference that
        sampled them, for a reward that asks the policy (a plain function is not given it)."""
        del policy
        score = self.ascore if self.is_async else self.score
        parts = [[sample] for sample in samples] if self.batch == "completion" else [list(samples)]
        scored = await asyncio.gather(*(_failures_in_place(call, score, part) for part in parts))
        return [result for part in scored for result in part]

    def score(self, samples: Sequence[Sample]) -> list[Score | UserCodeFailure]:
        """One call of the function on `samples`, in this thread: a score, or the failure of a value that
        is no finite number, per sample. Raises `UserCodeFailure` when the call raises or returns no list
        of one value per sample."""
        arguments = self._arguments(samples)
        with self._users_code():
            returned = self.function(**arguments)
        return self._scores(returned, len(samples))

    async def ascore(self, samples: Sequence[Sample]) -> list[Score | UserCodeFailure]:
        """`score` of an ``async def`` function, awaited."""
        arguments = self._arguments(samples)
        with self._users_code():
            returned = await self.function(**arguments)
        return self._scores(returned, len(samples))

    @contextlib.contextmanager
    def _users_code(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            raise UserCodeFailure(code_location(exc, self.function), f"{type(exc).__name__}: {exc}") from exc

    def _arguments(self, samples: Sequence[Sample]) -> dict[str, Any]:
        if self.style == "verl":
            (sample,) = samples
            arguments = {
                "data_source": sample.data_source,
                "solution_str": sample.completion,
                "ground_truth": sample.ground_truth,
                "extra_info": sample.extra_info,
            }
        else:
            arguments = {
                "prompts": [sample.prompt for sample in samples],
                "completions": [_trl_completion(sample) for sample in samples],
                "completion_ids": [sample.completion_ids for sample in samples],
            }
            columns = [name for name in samples[0].columns if name not in arguments]
            arguments |= {name: [sample.columns[name] for sample in samples] for name in columns}
        return _accepted(self.function, arguments)

    def _scores(self, returned: Any, count: int) -> list[Score | UserCodeFailure]:
        if self.style == "verl":
            return [self._verl_score(returned)]
        if isinstance(returned, str | bytes) or not hasattr(returned, "__len__") or len(returned) != count:
            raise UserCodeFailure.returned(
                self.location, returned, f"a list with one value per completion ({count})"
            )
        return [self._trl_score(value) for value in returned]

    def _trl_score(self, value: Any) -> Score | UserCodeFailure:
        if value is None:
            return None, {}
        number = finite_number(value)
        if number is None:
            return UserCodeFailure.returned(self.location, value, "a finite number (or None: not scored)")
        return number, {}

    def _verl_score(self, result: Any) -> Score:
        score = result.get("score") if isinstance(result, Mapping) else result
        if isinstance(result, Mapping) and "score" not in result:
            raise UserCodeFailure(self.location, f"returned a dict without 'score': {sorted(result)}")
        value = finite_number(score)
        if value is None:
            raise UserCodeFailure.returned(self.location, score, "a finite number")
        extras = {
            f"{self.name}/{key}": float(extra)
            for key, extra in (result.items() if isinstance(result, Mapping) else ())
            if key != "score" and isinstance(extra, int | float) and math.isfinite(extra)
        }
        return value, extras


def _trl_completion(sample: Sample) -> Any:
    """TRL's completion: text, or for chat prompts the reply as a list of one assistant message."""
    if isinstance(sample.prompt, str):
        return sample.completion
    return [{"role": "assistant", "content": sample.completion}]


async def _failures_in_place(
    call: Caller, score: Callable[..., Any], samples: list[Sample]
) -> list[Score | Exception]:
    try:
        return await call(score, samples)
    except Exception as exc:  # the call raised, returned no list of the right length or timed out
        return [exc] * len(samples)


async def call_here(fn: Callable[..., Any], *args: Any) -> Any:
    """A `Caller` that runs the call in this thread (synchronous code, tests)."""
    return await fn(*args) if inspect.iscoroutinefunction(fn) else fn(*args)


async def combine_group(
    functions: Sequence[RewardFunction],
    samples: Sequence[Sample],
    call: Caller,
    policy: PolicyInference | None = None,
) -> list[Reward | Exception]:
    """The reward of each of one group's samples: the weighted sum of the functions that apply, with
    every value by name. The functions score the group concurrently, each run by `call`; `policy` is the
    inference that sampled them (for a judge that is the policy itself).

    A sample gets a failure in place of its reward when a function failed for it (the first such
    function's, in list order), or when none applies (all returned None): such a sample has no
    reward, and scoring it 0 would train on a reward nobody gave."""
    scores = await asyncio.gather(*(function.score_group(samples, call, policy) for function in functions))
    return [_combined(functions, [scored[i] for scored in scores]) for i in range(len(samples))]


def combine(functions: Sequence[RewardFunction], sample: Sample) -> Reward:
    """`combine_group` of one sample, from synchronous code: raises the sample's failure."""
    (reward,) = asyncio.run(combine_group(functions, [sample], call_here))
    if isinstance(reward, Exception):
        raise reward
    return reward


def _combined(functions: Sequence[RewardFunction], scores: list[Score | Exception]) -> Reward | Exception:
    total, components, applied = 0.0, {}, False
    for function, score in zip(functions, scores, strict=True):
        if isinstance(score, Exception):
            return score
        value, extras = score
        components |= extras
        if value is not None:
            components[function.name] = value
            total += function.weight * value
            applied = True
    if applied:
        return Reward(total, components)
    if len(functions) == 1:
        return UserCodeFailure(
            functions[0].location,
            "returned None (not scored) and no other reward function scored the completion: it has no reward",
        )
    every = ", ".join(f"{f.name} ({f.location})" for f in functions)
    return UserCodeFailure(
        None, f"every reward function returned None (not scored): {every}; it has no reward"
    )


def _parameters(function: Callable[..., Any]) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: assume they take anything
        return [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]


def _style_of(function: Callable[..., Any], where: str) -> Style:
    names = [p.name for p in _parameters(function)]
    if "solution_str" in names:
        return "verl"
    if "completions" in names:
        return "trl"
    raise ValueError(
        f"{where}: cannot tell the calling convention of {getattr(function, '__name__', function)} from its "
        f"parameters {names}; TRL-style functions take `completions`, verl-style ones `solution_str` "
        "(or set style: trl / style: verl)"
    )


def _accepted(function: Callable[..., Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """`arguments` the function can take: all of them with ``**kwargs``, else only those it names."""
    parameters = _parameters(function)
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return arguments
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {name: value for name, value in arguments.items() if name in names}


def finite_number(value: Any) -> float | None:
    """`value` as a float when it is a finite real number (a bool, int or float, or a numpy or torch
    scalar), else None; a string is not a number, whatever it spells."""
    if not isinstance(value, bool | int | float) and hasattr(value, "item"):  # a numpy or torch scalar
        try:
            value = value.item()
        except (TypeError, ValueError):  # an array of several values
            return None
    if isinstance(value, bool | int | float) and math.isfinite(value):
        return float(value)
    return None
