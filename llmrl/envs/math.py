"""Math word problems (MATH, GSM8K): the marked final answer, checked for equivalence with math-verify.

The completion's answer is the last ``\\boxed{...}``, else the last ``<answer>...</answer>``, else
what follows GSM8K's last ``####``; a completion that marks none scores 0. The answer and the
reference are parsed as LaTeX by `math-verify` (Hugging Face) and compared symbolically
(``\\frac{1}{2}`` = ``0.5``, ``1,000`` = ``1000``, ``x+1`` = ``1+x``).

Optional penalties, subtracted from the 0/1 correctness: `truncation_penalty` for a completion
that hit max_tokens, `trailing_penalty` for text after the marked answer (rambling on after
answering). The reward itself is `llmrl.rewards.answers.math_reward`.
"""

from __future__ import annotations

from typing import Any

from llmrl.agents.base import Problem
from llmrl.agents.dataset import DatasetAgent, packaged_data
from llmrl.rewards.answers import extract_answer, math_reward
from llmrl.types import InferenceResponse

INSTRUCTION = "Reason step by step, and put your final answer within \\boxed{{}}."


class MathAgent(DatasetAgent):
    """MATH-style problems (a ``problem`` and a worked ``solution`` ending in ``\\boxed{}``)."""

    default_data = ("math_train.jsonl", "math_test.jsonl")
    """Packaged training and evaluation files used when the config names no data."""

    def __init__(
        self,
        *,
        data_files: str | list[str] | None = None,
        eval_data_files: str | list[str] | None = None,
        prompt_column: str = "problem",
        answer_column: str = "solution",
        prompt_template: str = "{prompt}\n\n" + INSTRUCTION,
        truncation_penalty: float = 0.0,
        trailing_penalty: float = 0.0,
        **kwargs: Any,
    ):
        """
        Args:
            data_files / eval_data_files: local data (default: the small fixture shipped with llmrl,
                unless `path` names a hub dataset or `dataset` is given).
            truncation_penalty / trailing_penalty: subtracted from the reward (see the module docstring).
            **kwargs: `DatasetAgent` options (path, split, system_prompt, chat, eval_size, ...).
        """
        if truncation_penalty < 0 or trailing_penalty < 0:
            raise ValueError("truncation_penalty and trailing_penalty must be >= 0")
        self.truncation_penalty = truncation_penalty
        self.trailing_penalty = trailing_penalty
        if data_files is None and kwargs.get("path") is None and kwargs.get("dataset") is None:
            data_files = packaged_data(self.default_data[0])
            eval_data_files = eval_data_files or packaged_data(self.default_data[1])
        super().__init__(
            data_files=data_files,
            eval_data_files=eval_data_files,
            prompt_column=prompt_column,
            answer_column=answer_column,
            prompt_template=prompt_template,
            **kwargs,
        )

    def answer_from_row(self, row: dict[str, Any]) -> str:
        """The final answer of a worked solution (its boxed or #### answer), or the whole cell."""
        solution = str(row[self.answer_column])
        marked = extract_answer(solution)
        return marked[0] if marked else solution.strip()

    def reward(self, response: InferenceResponse, problem: Problem) -> float:
        return math_reward(
            response.text,
            problem.answer,
            truncated=response.finish_reason == "length",
            truncation_penalty=self.truncation_penalty,
            trailing_penalty=self.trailing_penalty,
        )


class GSM8KAgent(MathAgent):
    """GSM8K: ``question`` and an ``answer`` whose last line is ``#### <number>``."""

    default_data = ("gsm8k_train.jsonl", "gsm8k_test.jsonl")

    def __init__(self, *, prompt_column: str = "question", answer_column: str = "answer", **kwargs: Any):
        super().__init__(prompt_column=prompt_column, answer_column=answer_column, **kwargs)
