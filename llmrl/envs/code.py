"""Python programming problems (MBPP / HumanEval style): the completion's code runs against tests.

A problem is a description and its tests: a list of independent test snippets (MBPP's
``test_list`` of asserts) or one block of test code (HumanEval's ``check``; then it is one test).
The completion's code is the last fenced code block (```` ```python ... ``` ````; an unclosed block
runs to the end), or the whole completion when it has none. It runs with the tests in one
`sandbox.run` (separate process, time/memory/file/process limits, no network) under the harness
of `llmrl.envs.code_harness`: the tests run in a checker process that the code cannot reach, calling
the code's functions in a second process and comparing the plain values they return. Code that
prints fake results, exits early, patches the runner or returns an object equal to everything
gains nothing (docs/agents.md, "Code environment").

Reward: the fraction of tests passed (``reward_mode: fraction``), or 1 only when all pass
(``reward_mode: all``). Code that runs out of time keeps the tests it passed before.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmrl.agents.base import Problem
from llmrl.agents.dataset import DatasetAgent, packaged_data
from llmrl.envs import sandbox
from llmrl.types import InferenceResponse

PROMPT_TEMPLATE = (
    "{prompt}\nYour code should pass these tests:\n\n{tests}\n\n"
    "Write the complete solution in a single ```python code block."
)

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The last fenced code block of a completion, or all of it when there is none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


HARNESS = Path(__file__).with_name("code_harness.py").read_text(encoding="utf-8")
"""The program each reward runs in the sandbox (`llmrl.envs.code_harness`)."""


@dataclass(frozen=True)
class HarnessReport:
    """The outcome of one solution's tests."""

    passed: list[bool]
    """One entry per test, in order; a test the run did not reach (time limit) did not pass."""
    sandbox: sandbox.SandboxResult


def run_tests(
    solution: str, tests: list[str], setup: str = "", *, timeout_s: float = 5.0, memory_mb: int = 512
) -> HarnessReport:
    """Run `setup`, then `solution`, then each test in the sandbox, behind the harness's two-process split.

    Only the harness's checker process writes the report read here (``llmrl.envs.code_harness``).
    """
    job = json.dumps({"setup": setup, "solution": solution, "tests": tests})
    result = sandbox.run(HARNESS, stdin=job, timeout_s=timeout_s, memory_mb=memory_mb)
    passed = [False] * len(tests)
    for line in result.stdout.splitlines():
        try:
            entry = json.loads(line)
            if entry["passed"] is True and entry["test"] >= 0:
                passed[entry["test"]] = True
        except (ValueError, KeyError, TypeError, IndexError):
            continue  # a run killed mid-line
    return HarnessReport(passed=passed, sandbox=result)


class CodeAgent(DatasetAgent):
    """MBPP-format problems (``text``, ``test_list``) scored by running the tests in the sandbox."""

    column_fields = (*DatasetAgent.column_fields, "setup_column")

    def __init__(
        self,
        *,
        data_files: str | list[str] | None = None,
        eval_data_files: str | list[str] | None = None,
        prompt_column: str = "text",
        answer_column: str = "test_list",
        setup_column: str | None = None,
        prompt_template: str = PROMPT_TEMPLATE,
        reward_mode: Literal["fraction", "all"] = "fraction",
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        **kwargs: Any,
    ):
        """
        Args:
            data_files / eval_data_files: local data (default: the small MBPP-format fixture shipped
                with llmrl, unless `path` names a hub dataset or `dataset` is given).
            answer_column: the tests: a list of snippets, or one string of test code.
            setup_column: code run before the solution (MBPP's ``test_setup_code``), if any.
            prompt_template: may use ``{tests}``, the tests one per line.
            reward_mode: ``fraction`` of tests passed, or ``all`` (1 only if every test passes).
            timeout_s / memory_mb: sandbox limits of one completion's run (all its tests).
            **kwargs: `DatasetAgent` options (path, split, system_prompt, chat, eval_size, ...).
        """
        if reward_mode not in ("fraction", "all"):
            raise ValueError(f"reward_mode must be 'fraction' or 'all', got {reward_mode!r}")
        sandbox.check_limits(timeout_s=timeout_s, memory_mb=memory_mb)
        self.setup_column = setup_column
        self.reward_mode = reward_mode
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        if data_files is None and kwargs.get("path") is None and kwargs.get("dataset") is None:
            data_files = packaged_data("mbpp_train.jsonl")
            eval_data_files = eval_data_files or packaged_data("mbpp_test.jsonl")
        # The reward waits for a whole sandbox run (plus process start-up on a busy machine).
        kwargs.setdefault("reward_timeout_s", 2 * timeout_s + 10)
        super().__init__(
            data_files=data_files,
            eval_data_files=eval_data_files,
            prompt_column=prompt_column,
            answer_column=answer_column,
            prompt_template=prompt_template,
            **kwargs,
        )

    def _tests(self, row: dict[str, Any]) -> list[str]:
        tests = row[self.answer_column]
        return [tests] if isinstance(tests, str) else [str(t) for t in tests]

    def template_fields(self, row: dict[str, Any]) -> dict[str, Any]:
        return {**super().template_fields(row), "tests": "\n".join(self._tests(row))}

    def answer_from_row(self, row: dict[str, Any]) -> dict[str, Any]:
        setup = str(row[self.setup_column] or "") if self.setup_column else ""
        return {"tests": self._tests(row), "setup": setup}

    def reward(self, response: InferenceResponse, problem: Problem) -> float:
        tests = problem.answer["tests"]
        run = run_tests(
            extract_code(response.text),
            tests,
            problem.answer["setup"],
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
        )
        if self.reward_mode == "all":
            return float(all(run.passed))
        return sum(run.passed) / len(tests)
