"""Problems from Hugging Face `datasets`: a hub name or local json/jsonl/csv/parquet/arrow files.

The config maps the data's columns onto a problem::

    agent_type: dataset
    agent_args:
      data_files: data/trivia.jsonl        # or path: some-org/some-dataset (where a hub is reachable)
      eval_data_files: data/trivia_test.jsonl
      prompt_column: question
      answer_column: answer
      prompt_template: "Answer briefly. {prompt}"   # any column can be used: {question}, {topic}, ...
      system_prompt: You are a helpful assistant.

From Python (`llmrl.train`), ``dataset`` and ``eval_dataset`` take `datasets.Dataset` objects in
place of the files or the hub dataset.

Three layouts are read, detected from the prompt column of the first row (``format:`` overrides):

* ``flat``: a text prompt column; the prompt is `prompt_template` filled with the row's columns
  (``{prompt}`` is the prompt column), sent as chat messages (`chat: true`) or as plain text.
* ``conversational`` (TRL's): the prompt column holds a list of ``{role, content}`` messages, sent
  as they are; `system_prompt` is put first only when the messages have no system message.
* ``verl`` (verl's preprocessing scripts, DAPO-Math-17k): messages as above plus a ``reward_model``
  struct column; the answer defaults to ``reward_model.ground_truth``, and the reward to
  `llmrl.rewards.default_compute_score`, which picks the scorer from the row's ``data_source``.

A column may be a path into struct columns (``reward_model.ground_truth``) in every layout. The
reward is the weighted sum of `reward_functions` (TRL- or verl-style plain functions, see
`llmrl.rewards.functions`) when given; otherwise an exact match of the answer the model marks
(``\\boxed{...}``, ``<answer>...</answer>`` or GSM8K's ``#### ...``; else the whole completion)
against the answer column, after light normalisation. Environments such as `math` and `code`
subclass this agent to keep the loading and replace the reward.
"""

from __future__ import annotations

import functools
import importlib.resources
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from llmrl.agents.base import Problem, make_prompt
from llmrl.agents.reward_only import RewardOnlyAgent
from llmrl.config import describe_python_object
from llmrl.inference.interface import InferenceInterface
from llmrl.inference.judge import JudgeReward, judge_reward_function
from llmrl.models.reward_model import reward_model_function
from llmrl.rewards.answers import extract_answer, normalize_answer
from llmrl.rewards.functions import Reward, RewardFunction, Sample, combine, combine_group
from llmrl.rewards.scorers import default_compute_score
from llmrl.types import ChatMessage, InferenceResponse, validation_problems

Layout = Literal["flat", "conversational", "verl"]
LAYOUTS: tuple[str, ...] = ("auto", "flat", "conversational", "verl")
_DEFAULT_ANSWER_COLUMN = {"flat": "answer", "conversational": "answer", "verl": "reward_model.ground_truth"}

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def packaged_data(name: str) -> str:
    """Path of a small data file shipped in `llmrl/data/` (fixtures that make every env run offline)."""
    path = Path(str(importlib.resources.files("llmrl"))) / "data" / name
    assert path.is_file(), f"packaged data file {name} is missing"
    return str(path)


def load_rows(
    *,
    path: str | None = None,
    data_files: str | Sequence[str] | None = None,
    name: str | None = None,
    split: str = "train",
) -> list[dict[str, Any]]:
    """Rows of a hub dataset split (`path`, `name`, `split`) or of local files (`data_files`)."""
    import datasets  # deferred: importing datasets takes over a second

    if (path is None) == (data_files is None):
        raise ValueError("give exactly one of path (a hub dataset name) and data_files (local files)")
    if path is not None:
        return datasets.load_dataset(path, name, split=split).to_list()
    files = [data_files] if isinstance(data_files, str) else list(data_files)
    if not files:
        raise ValueError("data_files is empty")
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise ValueError(f"data_files: no such file: {', '.join(missing)}")
    suffixes = {Path(f).suffix.lower() for f in files}
    if len(suffixes) != 1 or next(iter(suffixes)) not in _BUILDERS:
        raise ValueError(
            f"data_files must all have one of the extensions {', '.join(_BUILDERS)}; got {sorted(suffixes)}"
        )
    builder = _BUILDERS[suffixes.pop()]
    return datasets.load_dataset(builder, data_files=files, split="train").to_list()


def dataset_rows(dataset: Any, argument: str) -> tuple[list[dict[str, Any]], str]:
    """The rows of a `datasets.Dataset` given in Python as `argument`, and how errors name it."""
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(
            f"{argument}: a DatasetDict of {sorted(dataset)}; give one split, e.g. {argument}['train']"
        )
    if not isinstance(dataset, datasets.Dataset):
        raise ValueError(
            f"{argument}: expected a datasets.Dataset (given in Python, llmrl.train), got {_shown(dataset)}"
        )
    return dataset.to_list(), f"{argument} {describe_python_object(dataset)}"


@dataclass(frozen=True)
class ProblemRows:
    """An agent's problems as data rows: the training rows, the separate evaluation rows (None: held out
    of the training rows), and how errors name each source."""

    rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]] | None
    source: str
    eval_source: str

    @classmethod
    def load(
        cls,
        *,
        path: str | None,
        data_files: str | Sequence[str] | None,
        name: str | None,
        split: str,
        eval_split: str | None,
        eval_data_files: str | Sequence[str] | None,
        dataset: Any,
        eval_dataset: Any,
    ) -> ProblemRows:
        """From a hub dataset (`path`, `split`, `eval_split`), local files (`data_files`,
        `eval_data_files`) or `datasets.Dataset` objects given in Python (`dataset`, `eval_dataset`)."""
        if eval_split is not None and path is None:
            raise ValueError("eval_split needs path (a hub dataset); for local files use eval_data_files")
        if eval_data_files is not None and data_files is None:
            raise ValueError("eval_data_files needs data_files; for a hub dataset use eval_split")
        if dataset is not None and (path is not None or data_files is not None):
            raise ValueError("give dataset, or path or data_files, not both")
        if eval_dataset is not None and (eval_split is not None or eval_data_files is not None):
            raise ValueError("give eval_dataset, or eval_split or eval_data_files, not both")
        if dataset is None:
            rows, source = (
                load_rows(path=path, data_files=data_files, name=name, split=split),
                _describe_source(path, data_files, split),
            )
        else:
            rows, source = dataset_rows(dataset, "dataset")
        eval_rows, eval_source = None, _describe_source(path, eval_data_files, eval_split or split)
        if eval_dataset is not None:
            eval_rows, eval_source = dataset_rows(eval_dataset, "eval_dataset")
        elif eval_split is not None or eval_data_files is not None:
            eval_rows = load_rows(path=path, data_files=eval_data_files, name=name, split=eval_split or split)
        return cls(rows, eval_rows, source, eval_source)


class RowProblems(ABC):
    """`prompts()` and `eval_prompts()` of an agent whose problems are data rows, one problem a row:
    the training rows (`_rows`) and the separate evaluation rows, if any (`_eval_rows`). A problem's
    id is its `id_column` value, else its split and row number; a subclass says how a row becomes a
    prompt, and an answer."""

    id_column: str | None
    _rows: list[dict[str, Any]]
    _eval_rows: list[dict[str, Any]] | None
    _sources: tuple[str, str]
    """How messages name where the training rows and the separate evaluation rows come from."""

    @staticmethod
    def value(row: dict[str, Any], column: str) -> Any:
        """`row`'s value of `column`: a column name, or a dotted path into struct columns."""
        if column in row:
            return row[column]
        head, *fields = column.split(".")
        if not fields or head not in row:
            raise ValueError(f"not a column; the data's columns are {list(row)}")
        value, walked = row[head], head
        for name in fields:
            if not isinstance(value, dict):
                raise ValueError(
                    f"{walked!r} holds {_shown(value)}, not a struct; the data's columns are {list(row)}"
                )
            if name not in value:
                raise ValueError(
                    f"the struct {walked!r} has no field {name!r}, only {list(value)}; the data's columns are {list(row)}"
                )
            value, walked = value[name], f"{walked}.{name}"
        return value

    @abstractmethod
    def prompt_from_row(self, row: dict[str, Any], split: str, index: int) -> str | list[ChatMessage]:
        """The prompt of row `index` of `split` (``train`` or ``eval``)."""

    def answer_from_row(self, row: dict[str, Any]) -> Any:
        """The reference stored in `Problem.answer` (none unless a subclass reads one)."""
        del row
        return None

    def _problems(self, rows: list[dict[str, Any]], split: str) -> list[Problem]:
        source = self._sources[split != "train"]
        return [
            Problem(
                id=str(self.value(row, self.id_column)) if self.id_column else f"{split}-{index}",
                prompt=self.prompt_from_row(row, split, index),
                answer=self.answer_from_row(row),
                row=row,
                origin=f"{source}, row {index} counting from 0",
            )
            for index, row in enumerate(rows)
        ]

    def prompts(self) -> list[Problem]:
        return self._problems(self._rows, "train")

    def eval_prompts(self) -> list[Problem] | None:
        return None if self._eval_rows is None else self._problems(self._eval_rows, "eval")


class DatasetAgent(RowProblems, RewardOnlyAgent):
    """Problems from a dataset with a column mapping; reward functions, or exact match on the marked
    answer."""

    column_fields: tuple[str, ...] = ("prompt_column", "answer_column", "id_column")
    """Attributes that name columns; each must exist in the data (None skips one)."""

    def __init__(
        self,
        *,
        path: str | None = None,
        data_files: str | list[str] | None = None,
        name: str | None = None,
        split: str = "train",
        eval_split: str | None = None,
        eval_data_files: str | list[str] | None = None,
        dataset: Any = None,
        eval_dataset: Any = None,
        format: Literal["auto", "flat", "conversational", "verl"] = "auto",
        prompt_column: str = "prompt",
        answer_column: str | None = None,
        id_column: str | None = None,
        data_source: str | None = None,
        system_prompt: str | None = None,
        prompt_template: str = "{prompt}",
        chat: bool = True,
        reward_functions: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ):
        """
        Args:
            path / name / split: hub dataset name, its config and the training split.
            data_files: local files instead of `path` (json, jsonl, csv, parquet or arrow).
            eval_split / eval_data_files: held-out evaluation data; without them `eval_size` rows are held
            out.
            dataset / eval_dataset: a `datasets.Dataset` (from Python, `llmrl.train`) in place of `path` or
                `data_files`, and of `eval_split` or `eval_data_files`.
            format: the data's layout, ``flat``, ``conversational`` or ``verl``; ``auto`` detects it.
            prompt_column / answer_column / id_column: column mapping (ids default to the row number); a
                column may be a dotted path into struct columns. The answer defaults to ``answer``, or
                ``reward_model.ground_truth`` in the verl layout; without reward functions it is required.
            data_source: the data source of rows without a ``data_source`` column (verl-style rewards).
            system_prompt: system message (chat) or preamble (plain text).
            prompt_template: ``str.format`` template over the row's columns; ``{prompt}`` is the prompt
                column (flat layout only).
            chat: send chat messages (for chat-tuned models) rather than plain text (flat layout).
            reward_functions: ``{function, weight, style, name, batch}`` entries (`llmrl.rewards.functions`)
                or reward models' ``{model, weight, name, batch, device, dtype}`` (`llmrl.models.reward_model`)
                or LLM judges' ``{judge: {...}, weight, name}`` (`llmrl.inference.judge`);
                default: exact match, or `default_compute_score` in the verl layout.
            **kwargs: `RewardOnlyAgent` options (eval_size, max_turns, timeouts, generation_args, ...).
        """
        super().__init__(**kwargs)
        if format not in LAYOUTS:
            raise ValueError(f"format: expected one of {list(LAYOUTS)}, got {format!r}")
        functions = [
            _reward_function(entry, f"reward_functions[{i}]")
            for i, entry in enumerate(reward_functions or [])
        ]
        if functions and type(self).reward is not DatasetAgent.reward:
            raise ValueError(
                f"reward_functions: {type(self).__name__} has a reward of its own; use agent_type dataset"
            )
        self.prompt_column = prompt_column
        self.id_column = id_column
        self.data_source = data_source
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template
        self.chat = chat
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
        self._rows, self._source = rows.rows, rows.source
        self._sources = (rows.source, rows.eval_source)
        self.layout: Layout = self._detect_layout(self._rows, self._source) if format == "auto" else format
        if not functions and self.layout == "verl":
            functions = [
                RewardFunction(default_compute_score, name="score", style="verl", batch="completion")
            ]
        self.reward_functions = functions
        self.answer_column = answer_column or _DEFAULT_ANSWER_COLUMN[self.layout]
        if answer_column is None and functions and not _has_column(self._rows[0], self.answer_column):
            self.answer_column = None  # reward functions that need no answer, on data without the default one
        self._eval_rows = rows.eval_rows
        for checked, source in ((rows.rows, rows.source), (rows.eval_rows, rows.eval_source)):
            if checked is not None:
                self._check_rows(checked, source)

    # ---- columns ---------------------------------------------------------------------------------

    def _detect_layout(self, rows: list[dict[str, Any]], source: str) -> Layout:
        if not rows:
            raise ValueError(f"{source}: no rows")
        prompt = self._checked_value(rows[0], "prompt_column", source)
        if isinstance(prompt, str):
            return "flat"
        if isinstance(prompt, list):
            return "verl" if isinstance(rows[0].get("reward_model"), dict) else "conversational"
        raise ValueError(
            f"{source}: prompt_column={self.prompt_column!r} holds {_shown(prompt)}; expected text or a list "
            f"of {{role, content}} messages"
        )

    def _checked_value(self, row: dict[str, Any], field: str, source: str) -> Any:
        """`value` of the column the attribute `field` names; errors name the file and the column."""
        column = getattr(self, field)
        try:
            return self.value(row, column)
        except ValueError as exc:
            raise ValueError(f"{source}: {field}={column!r}: {exc}") from None

    def _check_rows(self, rows: list[dict[str, Any]], source: str) -> None:
        if not rows:
            raise ValueError(f"{source}: no rows")
        columns = list(rows[0])
        for field in self.column_fields:
            if getattr(self, field) is not None:
                for row in rows:
                    self._checked_value(row, field, source)
        for function in self.reward_functions:
            function.check_columns(columns, f"reward_functions ({source})")
        if self.layout == "flat":
            try:
                self.prompt_template.format_map(self.template_fields(rows[0]))
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"prompt_template {self.prompt_template!r} cannot be filled ({type(exc).__name__}: {exc}); "
                    f"it may use {{prompt}} and the columns {columns}"
                ) from None
        elif not isinstance(first := self.value(rows[0], self.prompt_column), list) or not first:
            raise ValueError(
                f"{source}: prompt_column={self.prompt_column!r} holds {_shown(first)}; the {self.layout} layout "
                "needs a non-empty list of {role, content} messages"
            )
        elif self.prompt_template != "{prompt}" or not self.chat:
            raise ValueError(
                f"{source}: the prompts are chat messages ({self.layout} layout), sent as they are; "
                "prompt_template and chat: false apply to text prompts only"
            )

    def template_fields(self, row: dict[str, Any]) -> dict[str, Any]:
        """Values the prompt template can use: the row's columns plus ``prompt``."""
        return {**row, "prompt": self.value(row, self.prompt_column)}

    def answer_from_row(self, row: dict[str, Any]) -> Any:
        """The reference stored in `Problem.answer` (subclasses parse it here, once per problem)."""
        return None if self.answer_column is None else self.value(row, self.answer_column)

    # ---- problems --------------------------------------------------------------------------------

    def prompt_from_row(self, row: dict[str, Any], split: str, index: int) -> str | list[ChatMessage]:
        if self.layout == "flat":
            text = self.prompt_template.format_map(self.template_fields(row))
            return make_prompt(text, system_prompt=self.system_prompt, chat=self.chat)
        raw = self.value(row, self.prompt_column)
        try:
            messages = [ChatMessage.model_validate(message) for message in raw]
        except ValidationError as exc:
            source = self._source if split == "train" else f"the evaluation data ({self._source})"
            raise ValueError(
                f"{source}: row {index}, column {self.prompt_column!r}: not chat messages "
                f"({validation_problems(exc.errors()[:1])}); found {_shown(raw)}"
            ) from None
        if self.system_prompt and not any(m.role == "system" for m in messages):
            messages.insert(0, ChatMessage(role="system", content=self.system_prompt))
        return messages

    # ---- reward ----------------------------------------------------------------------------------

    async def score_episodes(
        self, responses: list[InferenceResponse], problem: Problem, inference: InferenceInterface | None
    ) -> list[float | Reward | BaseException]:
        """With reward functions: each scores the whole group at once (`combine_group`), its calls run as
        `reward` calls are (worker threads or awaited, `reward_concurrency` at a time); a judge without a
        server of its own asks `inference`, the policy's."""
        if not self.reward_functions:
            return await super().score_episodes(responses, problem, inference)
        samples = [self.sample(response, problem) for response in responses]
        return await combine_group(
            self.reward_functions, samples, functools.partial(self._call_env, span="reward"), inference
        )

    def reward(self, response: InferenceResponse, problem: Problem) -> float | Reward:
        if self.reward_functions:  # one completion, from synchronous code (a group: `score_episodes`)
            return combine(self.reward_functions, self.sample(response, problem))
        marked = extract_answer(response.text)
        answer = marked[0] if marked else response.text
        return float(normalize_answer(answer) == normalize_answer(str(problem.answer)))

    def pop_metrics(self) -> dict[str, float]:
        """The failure counters, and each LLM judge's requests and cache hits (``<name>/requests``,
        ``<name>/cache_hits``)."""
        metrics = super().pop_metrics()
        for function in self.reward_functions:
            if isinstance(function, JudgeReward):
                metrics |= {
                    f"{function.name}/{key}": value for key, value in function.judge.pop_counts().items()
                }
        return metrics

    def sample(self, response: InferenceResponse, problem: Problem) -> Sample:
        """What reward functions see of `response` to `problem`."""
        row = problem.row or {}
        prompt = (
            problem.prompt if isinstance(problem.prompt, str) else [m.model_dump() for m in problem.prompt]
        )
        return Sample(
            prompt=prompt,
            completion=response.text,
            completion_ids=list(response.token_ids),
            ground_truth=problem.answer,
            data_source=row.get("data_source", self.data_source),
            extra_info=row.get("extra_info"),
            columns={name: value for name, value in row.items() if name != self.prompt_column},
        )


def _reward_function(entry: Any, where: str) -> RewardFunction:
    """A reward function entry: a function's (`RewardFunction.from_config`), a reward model's (``model:``,
    `llmrl.models.reward_model`) or an LLM judge's (``judge:``, `llmrl.inference.judge`)."""
    if isinstance(entry, Mapping) and "model" in entry:
        return reward_model_function(entry, where)
    if isinstance(entry, Mapping) and "judge" in entry:
        return judge_reward_function(entry, where)
    return RewardFunction.from_config(entry, where)


def _has_column(row: dict[str, Any], column: str) -> bool:
    try:
        DatasetAgent.value(row, column)
    except ValueError:
        return False
    return True


def _describe_source(path: str | None, data_files: str | Sequence[str] | None, split: str) -> str:
    """How errors name the data: its file(s), or the hub dataset and split."""
    if data_files is not None:
        return ", ".join([data_files] if isinstance(data_files, str) else data_files)
    return f"{path} (split {split})"


def _shown(value: Any) -> str:
    """A value's type and a short form of it, for error messages."""
    text = repr(value)
    return f"{type(value).__name__} {text[:120]}{'...' if len(text) > 120 else ''}"
