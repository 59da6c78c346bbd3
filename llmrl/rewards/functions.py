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

Functions are called once per rollout (lists of one sample in TRL style), in the agent's reward
worker threads, so a function that raises or hangs affects that rollout only (it becomes a
placeholder). The reward is ``sum(weight * value)`` over the functions that apply; each value is
also reported under the function's name (`Reward.components`), and so logged as
``reward/<env>/<name>``. A rollout no function applies to (all returned None) has no reward: it
fails like a function that raises, rather than scoring 0.

A function that raises, or returns something other than a finite number (a string, NaN, inf, a
list of the wrong length), raises `UserCodeFailure`, whose message starts with the file and line to
fix: the function's own frame where it raised, else its definition
(``my_rewards.py:12 in accuracy: returned '1.0'; expected a finite number``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from llmrl.errors import UserCodeFailure, code_location
from llmrl.registry import resolve_function

Style = Literal["trl", "verl"]
STYLES: tuple[str, ...] = ("trl", "verl")
_TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")
_RESERVED_NAMES = ("mean", "std", "pass_rate")
"""Metric names `rollout_metrics` already logs under ``reward/<env>/``."""


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

    @classmethod
    def from_config(cls, entry: Mapping[str, Any] | Callable[..., Any], where: str) -> RewardFunction:
        """An entry ``{function, weight, style, name}`` (or a bare callable); `where` prefixes errors.

        ``function`` is ``"module:name"`` for a module the config lists in ``plugins:``, or the name
        of a built-in scorer of `llmrl.rewards` (``default_compute_score``, ``math_dapo``, ...), or the
        function itself in a config built in Python (`llmrl.train`).
        """
        if callable(entry):
            entry = {"function": entry}
        if not isinstance(entry, Mapping):
            raise ValueError(
                f"{where}: expected a mapping with `function` (and `weight`, `style`, `name`), got {entry!r}"
            )
        unknown = sorted(set(entry) - {"function", "weight", "style", "name"})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; valid keys: function, weight, style, name")
        spec = entry.get("function")
        if spec is None:
            raise ValueError(f"{where}.function: required (e.g. my_rewards:accuracy)")
        try:
            function = spec if callable(spec) else resolve_function(spec)
        except ValueError as exc:
            raise ValueError(f"{where}.function: {exc}") from None
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ValueError(f"{where}.weight: expected a finite number, got {weight!r}")
        name = str(entry.get("name") or getattr(function, "__name__", "reward"))
        if name in _RESERVED_NAMES or "/" in name:
            raise ValueError(
                f"{where}.name: {name!r} is taken by a reward metric or has a '/'; set another name"
            )
        style = entry.get("style") or _style_of(function, where)
        if style not in STYLES:
            raise ValueError(f"{where}.style: expected one of {list(STYLES)}, got {style!r}")
        return cls(function=function, name=name, weight=float(weight), style=style)

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

    def __call__(self, sample: Sample) -> tuple[float | None, dict[str, float]]:
        """This function's value for `sample` (None: it does not apply) and the extra values it reports.

        Raises `UserCodeFailure` when the function raises or returns no usable value."""
        if self.style == "verl":
            return self._call_verl(sample)
        return self._call_trl(sample), {}

    def _call(self, arguments: dict[str, Any]) -> Any:
        try:
            return self.function(**_accepted(self.function, arguments))
        except Exception as exc:
            raise UserCodeFailure(code_location(exc, self.function), f"{type(exc).__name__}: {exc}") from exc

    @property
    def location(self) -> str | None:
        """Where the function is defined (``my_rewards.py:12 in accuracy``): what a failure for what it
        returned points at."""
        return code_location(None, self.function)

    def _call_trl(self, sample: Sample) -> float | None:
        conversational = not isinstance(sample.prompt, str)
        completion: Any = (
            [{"role": "assistant", "content": sample.completion}] if conversational else sample.completion
        )
        arguments = {
            "prompts": [sample.prompt],
            "completions": [completion],
            "completion_ids": [sample.completion_ids],
        }
        arguments |= {name: [value] for name, value in sample.columns.items() if name not in arguments}
        values = self._call(arguments)
        if isinstance(values, str | bytes) or not hasattr(values, "__len__") or len(values) != 1:
            raise UserCodeFailure.returned(self.location, values, "a list with one value per completion")
        if values[0] is None:
            return None
        value = finite_number(values[0])
        if value is None:
            raise UserCodeFailure.returned(self.location, values[0], "a finite number (or None: not scored)")
        return value

    def _call_verl(self, sample: Sample) -> tuple[float, dict[str, float]]:
        arguments = {
            "data_source": sample.data_source,
            "solution_str": sample.completion,
            "ground_truth": sample.ground_truth,
            "extra_info": sample.extra_info,
        }
        result = self._call(arguments)
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


def combine(functions: list[RewardFunction], sample: Sample) -> Reward:
    """The weighted sum of the functions that apply to `sample`, with every value by name.

    Raises `UserCodeFailure` when a function fails, or when none applies (all returned None): such a
    sample has no reward, and scoring it 0 would train on a reward nobody gave."""
    total, components, applied = 0.0, {}, False
    for function in functions:
        value, extras = function(sample)
        components |= extras
        if value is not None:
            components[function.name] = value
            total += function.weight * value
            applied = True
    if not applied:
        if len(functions) == 1:
            raise UserCodeFailure(
                functions[0].location,
                "returned None (not scored) and no other reward function scored the completion: it has no reward",
            )
        every = ", ".join(f"{f.name} ({f.location})" for f in functions)
        raise UserCodeFailure(
            None, f"every reward function returned None (not scored): {every}; it has no reward"
        )
    return Reward(total, components)


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
