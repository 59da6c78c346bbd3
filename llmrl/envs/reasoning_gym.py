"""reasoning-gym: procedurally generated reasoning tasks, scored by the library's own `score_answer`.

reasoning-gym (the `reasoning-gym` extra) generates 100+ verifiable tasks (arithmetic, puzzles, logic,
graphs, ...) with no download: a task's generator and its config give entries ``{question, answer,
metadata}``, and the task's `score_answer(answer, entry)` grades an answer in [0, 1] (partial credit
where the task gives it). One task is ``dataset: NAME`` with its generator's ``config``; a weighted mix
is ``datasets: {NAME: {weight, config}}``, drawn by the library's `CompositeDataset`.

The training problems are the first `size` entries of a draw seeded from the run's seed, so the same
config gives the same problems on any machine. The held-out evaluation problems are `eval_size` entries
of a draw whose seed does not depend on the run's: evaluations of runs with other seeds or sizes
compare on the same problems. Training questions equal to a held-out one are left out (and so are
repeats within a draw: small problem spaces repeat), so evaluation never scores a problem trained on;
with a small problem space there may be fewer training problems than `size`.

The reward is `score_answer` on the answer extracted from the completion (`answer_format`), or on None
when it gives none (nearly every task scores that 0, a few 0.01). A `score_answer` that raises is a
reward failure of that rollout (a placeholder, counted), never a crash. Each reward carries its task's
name as its component, so a mix logs ``reward/<env>/<task>``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import math
from collections.abc import Mapping
from typing import Any, Literal

from llmrl.agents.base import Problem, make_prompt
from llmrl.agents.reward_only import RewardOnlyAgent
from llmrl.errors import UserCodeFailure, UserError
from llmrl.rewards import answers
from llmrl.rewards.functions import Reward
from llmrl.seeding import derive_seed
from llmrl.types import InferenceResponse

MISSING_EXTRA = "agent_type reasoning_gym needs the reasoning-gym extra: pip install 'llmrl[reasoning-gym]'"

DEFAULT_SYSTEM_PROMPT = (
    "Solve the problem step by step. Then give only the final answer, in the form the problem asks for, "
    "between <answer> and </answer> tags."
)

AnswerFormat = Literal["answer_tags", "marked", "completion"]

# Some generators seed numpy with `seed + index`, which must stay below 2**32.
_SEED_RANGE = 2**31

# The held-out draw's seed: fixed, so that runs of any seed evaluate on the same problems.
_HELD_OUT_SEED = derive_seed(0, "reasoning_gym", "held-out") % _SEED_RANGE


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(MISSING_EXTRA) from None
    return reasoning_gym


class ReasoningGymAgent(RewardOnlyAgent):
    """One reasoning-gym task, or a weighted mix of them, with the tasks' own scoring."""

    def __init__(
        self,
        *,
        dataset: str | None = None,
        config: Mapping[str, Any] | None = None,
        datasets: Mapping[str, Mapping[str, Any]] | None = None,
        size: int = 1000,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        answer_format: AnswerFormat = "answer_tags",
        chat: bool = True,
        **kwargs: Any,
    ):
        """
        Args:
            dataset / config: one task by its reasoning-gym name, and its generator's config.
            datasets: a weighted mix instead, ``{NAME: {weight: W, config: {...}}}`` (weight default 1).
            size: training entries drawn (repeats and held-out questions removed).
            system_prompt: None for none; the default asks for the answer in <answer> tags.
            answer_format: ``answer_tags``: the last <answer>...</answer> (reasoning-gym's convention);
                ``marked``: the last \\boxed{}, else <answer> tags, else what follows ``####``;
                ``completion``: the whole reply, stripped (a model that answers bare, as the tiny one does).
            chat: chat messages (for chat-tuned models), else plain text.
            **kwargs: `RewardOnlyAgent` options (eval_size: held-out problems, default 64).
        """
        reasoning_gym = _import_reasoning_gym()
        if (dataset is None) == (datasets is None):
            raise ValueError(
                "give either dataset (one task) or datasets (a weighted mix), not both or neither"
            )
        if datasets is not None and config is not None:
            raise ValueError("config: goes inside each entry of datasets ({NAME: {weight, config}})")
        if size < 1:
            raise ValueError(f"size: must be >= 1, got {size}")
        if answer_format not in ("answer_tags", "marked", "completion"):
            raise ValueError(
                f"answer_format: expected 'answer_tags', 'marked' or 'completion', got {answer_format!r}"
            )
        super().__init__(**kwargs)
        self.weights: dict[str, float] = {}
        self.configs: dict[str, dict[str, Any]] = {}
        self.tasks: dict[str, Any] = {}
        """Each task's dataset, whose `score_answer` grades its entries."""
        if dataset is not None:
            self._add_task(reasoning_gym, dataset, 1.0, config, name_field="dataset", config_field="config")
        elif not isinstance(datasets, Mapping) or not datasets:
            raise ValueError("datasets: expected a mapping {NAME: {weight: W, config: {...}}} of one or more")
        else:
            for name, entry in datasets.items():
                where = f"datasets.{name}"
                entry = entry or {}
                if not isinstance(entry, Mapping) or set(entry) - {"weight", "config"}:
                    raise ValueError(f"{where}: expected a mapping with weight and config, got {entry!r}")
                weight = entry.get("weight", 1.0)
                if (
                    isinstance(weight, bool)
                    or not isinstance(weight, int | float)
                    or not 0 < weight < math.inf
                ):
                    raise ValueError(f"{where}.weight: expected a number > 0, got {weight!r}")
                self._add_task(
                    reasoning_gym,
                    name,
                    weight,
                    entry.get("config"),
                    name_field="datasets",
                    config_field=f"{where}.config",
                )
        self.size = size
        self.system_prompt = system_prompt
        self.answer_format = answer_format
        self.chat = chat

    def _add_task(
        self, reasoning_gym: Any, name: str, weight: float, config: Any, *, name_field: str, config_field: str
    ) -> None:
        """Task `name` with its generator's `config`, checked by reasoning-gym; errors name the fields."""
        registry = reasoning_gym.factory.DATASETS
        valid = sorted(set(registry) - {"composite"})
        if name not in valid:
            shown = difflib.get_close_matches(str(name), valid, n=5) or valid[:8]
            raise ValueError(
                f"{name_field}: unknown reasoning-gym dataset {name!r}; e.g. {', '.join(shown)} ({len(valid)} in all)"
            )
        if not isinstance(config, Mapping | None):
            raise ValueError(f"{config_field}: expected a mapping of {name}'s config fields, got {config!r}")
        config = dict(config or {})
        fields = {f.name for f in dataclasses.fields(registry[name][1])} - {"seed", "size"}
        for key in config:
            if key in ("seed", "size"):
                raise ValueError(
                    f"{config_field}.{key}: set by the agent (from the run's seed, and size/eval_size)"
                )
            if key not in fields:
                raise ValueError(
                    f"{config_field}.{key}: not a field of {name}'s config; valid: {', '.join(sorted(fields))}"
                )
        try:
            self.tasks[name] = reasoning_gym.create_dataset(name, **config)
        except (AssertionError, TypeError, ValueError) as exc:  # its configs check with bare asserts
            raise ValueError(f"{config_field} ({name}): {_message(exc)}") from None
        self.weights[name] = float(weight)
        self.configs[name] = config

    def _draw(self, seed: int, size: int) -> list[dict[str, Any]]:
        """`size` entries of the task (or the mix) drawn with `seed`."""
        if len(self.configs) == 1:
            ((name, config),) = self.configs.items()
            dataset = _import_reasoning_gym().create_dataset(name, **config, seed=seed, size=size)
        else:
            from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

            specs = [DatasetSpec(name, self.weights[name], dict(cfg)) for name, cfg in self.configs.items()]
            dataset = CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=specs))
        try:
            return list(dataset)
        except Exception as exc:  # a config the task accepted but cannot generate from
            raise UserError(
                f"{self.env_id}: reasoning-gym failed to generate a problem: {_message(exc)}"
            ) from exc

    def task_of(self, entry: Mapping[str, Any]) -> str:
        """The name of the task that generated `entry`."""
        return entry["metadata"].get("source_dataset") or next(iter(self.tasks))

    def _problems(self, entries: list[dict[str, Any]], excluded: set[str]) -> list[Problem]:
        """The entries as problems, in order, leaving out repeated questions and those in `excluded`."""
        problems: dict[str, Problem] = {}
        for entry in entries:
            question = entry["question"]
            if question in excluded or question in problems:
                continue
            digest = hashlib.sha256(question.encode()).hexdigest()[:12]
            prompt = make_prompt(question, system_prompt=self.system_prompt, chat=self.chat)
            problems[question] = Problem(f"{self.task_of(entry)}/{digest}", prompt, answer=entry)
        return list(problems.values())

    @functools.cached_property
    def _held_out(self) -> list[Problem]:
        return self._problems(self._draw(_HELD_OUT_SEED, self.eval_size), set()) if self.eval_size else []

    def eval_prompts(self) -> list[Problem]:
        return self._held_out

    def prompts(self) -> list[Problem]:
        held_out = {problem.answer["question"] for problem in self._held_out}
        seed = derive_seed(self.seed, "reasoning_gym", "train") % _SEED_RANGE
        return self._problems(self._draw(seed, self.size), held_out)

    def extract(self, completion: str) -> str | None:
        """The answer the completion gives, in `answer_format`; None when it gives none."""
        if self.answer_format == "answer_tags":
            from reasoning_gym.utils import extract_answer

            return extract_answer(completion)
        if self.answer_format == "completion":
            return completion.strip() or None
        marked = answers.extract_answer(completion)
        return marked[0] if marked else None

    def reward(self, response: InferenceResponse, problem: Problem) -> Reward:
        entry = problem.answer
        task = self.task_of(entry)
        try:
            score = float(self.tasks[task].score_answer(answer=self.extract(response.text), entry=entry))
        except Exception as exc:
            raise UserCodeFailure(
                f"reasoning-gym {task}.score_answer", f"{type(exc).__name__}: {exc}"
            ) from exc
        return Reward(score, {task: score})


def _message(exc: BaseException) -> str:
    """The library's message on one line (a bare assert has none: then the exception's type)."""
    return " ".join(str(exc).split()) or type(exc).__name__
