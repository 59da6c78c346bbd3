"""The agent of the built-in arithmetic environment: runs the task of `llmrl.rewards.arithmetic`.

Training draws from the `train` split, evaluation from the held-out `test` split. Reward: 1.0 when
the first integer in the completion equals the answer, else 0.0.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from llmrl.agents.base import Problem
from llmrl.agents.reward_only import RewardOnlyAgent
from llmrl.rewards.arithmetic import (
    ArithmeticProblem,
    Split,
    check_ops,
    operand_range,
    prompt_messages,
    sample_problems,
    score,
)
from llmrl.types import InferenceResponse

# Enumerate every problem (and so train on each once per epoch) when there are at most this many.
_ENUMERATE_UP_TO = 50_000


class ArithmeticAgent(RewardOnlyAgent):
    """The demo task as an agent: trains on the `train` split, evaluates on the held-out `test` split."""

    def __init__(
        self, *, digits: int = 2, ops: Sequence[str] = ("+",), num_problems: int = 4096, **kwargs: Any
    ):
        """
        Args:
            digits / ops: problem size and operations (see `iter_problems`).
            num_problems: training problems drawn when the split is too large to use whole (digits >= 3);
                smaller splits are used whole.
            **kwargs: `RewardOnlyAgent` options (eval_size sets the number of held-out problems).
        """
        operand_range(digits)
        check_ops(ops)
        if num_problems < 1:
            raise ValueError(f"num_problems must be >= 1, got {num_problems}")
        super().__init__(**kwargs)
        self.digits = digits
        self.ops = tuple(dict.fromkeys(ops))
        self.num_problems = num_problems

    @property
    def _enumerable(self) -> bool:
        return len(operand_range(self.digits)) ** 2 * len(self.ops) <= _ENUMERATE_UP_TO

    def _problems(self, split: Split, count: int | None) -> list[Problem]:
        """`count` problems of `split` in a fixed order; None: all of them (small problem spaces only)."""
        if self._enumerable:
            operands = operand_range(self.digits)
            every = (ArithmeticProblem.of(a, op, b) for a in operands for op in self.ops for b in operands)
            problems = [p for p in every if p.split == split]
            random.Random(f"arithmetic:{split}").shuffle(problems)
            problems = problems[:count]
        else:
            assert count is not None
            problems = sample_problems(count, digits=self.digits, ops=self.ops, split=split, seed=0)
        return [Problem(p.problem_id, prompt_messages(p), answer=p) for p in problems]

    def prompts(self) -> list[Problem]:
        return self._problems("train", None if self._enumerable else self.num_problems)

    def eval_prompts(self) -> list[Problem]:
        return self._problems("test", self.eval_size)

    def reward(self, response: InferenceResponse, problem: Problem) -> float:
        return score(response.text, problem.answer)
