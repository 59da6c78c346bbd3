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

The prompt is `prompt_template` filled with the row's columns (``{prompt}`` is the prompt column),
sent as chat messages (`chat: true`) or as plain text. The default reward is an exact match of the
answer the model marks (``\\boxed{...}``, ``<answer>...</answer>`` or GSM8K's ``#### ...``; else
the whole completion) against the answer column, after light normalisation; environments such as
`math` and `code` subclass this agent to keep the loading and replace the reward.
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmrl.agents.base import Problem, make_prompt
from llmrl.agents.reward_only import RewardOnlyAgent
from llmrl.types import InferenceResponse

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


# ---- answer conventions -------------------------------------------------------------------------


def last_boxed(text: str) -> tuple[str, int] | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed) and the index just after it."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : i].strip(), i + 1
    return None


def last_tagged(text: str, tag: str = "answer") -> tuple[str, int] | None:
    """Content of the last ``<tag>...</tag>`` and the index just after it."""
    matches = list(re.finditer(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL))
    if not matches:
        return None
    return matches[-1].group(1).strip(), matches[-1].end()


def after_hashes(text: str) -> tuple[str, int] | None:
    """GSM8K's final answer: what follows the last ``####`` on its line."""
    matches = list(re.finditer(r"####[ \t]*([^\n]*)", text))
    if not matches or not matches[-1].group(1).strip():
        return None
    return matches[-1].group(1).strip(), matches[-1].end()


def extract_answer(text: str) -> tuple[str, int] | None:
    """The marked final answer and where it ends: ``\\boxed{}``, then ``<answer>`` tags, then ``####``."""
    return last_boxed(text) or last_tagged(text) or after_hashes(text)


def normalize_answer(answer: str) -> str:
    """Case, surrounding space and punctuation, thousands separators and numeric form ignored."""
    text = " ".join(answer.strip().strip(".").strip("$").lower().split())
    number = text.replace(",", "")
    try:
        value = float(number)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else repr(value)


class DatasetAgent(RewardOnlyAgent):
    """Problems from a dataset with a column mapping; exact-match reward on the marked answer."""

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
        prompt_column: str = "prompt",
        answer_column: str = "answer",
        id_column: str | None = None,
        system_prompt: str | None = None,
        prompt_template: str = "{prompt}",
        chat: bool = True,
        **kwargs: Any,
    ):
        """
        Args:
            path / name / split: hub dataset name, its config and the training split.
            data_files: local files instead of `path` (json, jsonl, csv, parquet or arrow).
            eval_split / eval_data_files: held-out evaluation data; without them `eval_size` rows are held out.
            prompt_column / answer_column / id_column: column mapping (ids default to the row number).
            system_prompt: system message (chat) or preamble (plain text).
            prompt_template: ``str.format`` template over the row's columns; ``{prompt}`` is the prompt column.
            chat: send chat messages (for chat-tuned models) rather than plain text.
            **kwargs: `RewardOnlyAgent` options (eval_size, max_turns, timeouts, generation_args, ...).
        """
        super().__init__(**kwargs)
        if eval_split is not None and path is None:
            raise ValueError("eval_split needs path (a hub dataset); for local files use eval_data_files")
        if eval_data_files is not None and data_files is None:
            raise ValueError("eval_data_files needs data_files; for a hub dataset use eval_split")
        self.prompt_column = prompt_column
        self.answer_column = answer_column
        self.id_column = id_column
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template
        self.chat = chat
        self._rows = load_rows(path=path, data_files=data_files, name=name, split=split)
        self._eval_rows = None
        if eval_split is not None or eval_data_files is not None:
            self._eval_rows = load_rows(
                path=path, data_files=eval_data_files, name=name, split=eval_split or split
            )
        for where, rows in (("data", self._rows), ("evaluation data", self._eval_rows)):
            if rows is not None:
                self._check_rows(rows, where)

    def _check_rows(self, rows: list[dict[str, Any]], where: str) -> None:
        if not rows:
            raise ValueError(f"the {where} has no rows")
        columns = list(rows[0])
        for field in self.column_fields:
            column = getattr(self, field)
            if column is not None and column not in columns:
                raise ValueError(
                    f"{field}={column!r} is not a column of the {where}; its columns are {columns}"
                )
        try:
            self.prompt_template.format_map(self.template_fields(rows[0]))
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"prompt_template {self.prompt_template!r} cannot be filled ({type(exc).__name__}: {exc}); "
                f"it may use {{prompt}} and the columns {columns}"
            ) from None

    def template_fields(self, row: dict[str, Any]) -> dict[str, Any]:
        """Values the prompt template can use: the row's columns plus ``prompt``."""
        return {**row, "prompt": row[self.prompt_column]}

    def answer_from_row(self, row: dict[str, Any]) -> Any:
        """The reference stored in `Problem.answer` (subclasses parse it here, once per problem)."""
        return row[self.answer_column]

    def _problems(self, rows: list[dict[str, Any]], split: str) -> list[Problem]:
        return [
            Problem(
                id=str(row[self.id_column]) if self.id_column else f"{split}-{index}",
                prompt=make_prompt(
                    self.prompt_template.format_map(self.template_fields(row)),
                    system_prompt=self.system_prompt,
                    chat=self.chat,
                ),
                answer=self.answer_from_row(row),
            )
            for index, row in enumerate(rows)
        ]

    def prompts(self) -> list[Problem]:
        return self._problems(self._rows, "train")

    def eval_prompts(self) -> list[Problem] | None:
        return None if self._eval_rows is None else self._problems(self._eval_rows, "eval")

    def reward(self, response: InferenceResponse, problem: Problem) -> float:
        marked = extract_answer(response.text)
        answer = marked[0] if marked else response.text
        return float(normalize_answer(answer) == normalize_answer(str(problem.answer)))
