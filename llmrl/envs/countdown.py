"""Countdown: combine the given numbers with + - * / to reach a target (the TinyZero task).

Problems are generated from `problem_seed`: `num_numbers` numbers in 1..max_number are combined in a
random order by random operations (division only when exact), so every problem has a solution; the
result is the target when it is a whole number in 1..max_target.

The reward is `llmrl.rewards.countdown.countdown_reward`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from llmrl.agents.base import Problem, make_prompt
from llmrl.agents.reward_only import RewardOnlyAgent
from llmrl.rewards.countdown import countdown_reward
from llmrl.types import InferenceResponse

PROMPT = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use +, -, *, / and "
    "parentheses, and must use each number exactly once. Think it through, then give only the "
    "equation in <answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>."
)


@dataclass(frozen=True)
class CountdownProblem:
    numbers: tuple[int, ...]
    target: int


def generate_problem(
    rng: random.Random, *, num_numbers: int = 4, max_number: int = 100, max_target: int = 100
) -> CountdownProblem:
    """A solvable problem: the target is the value of a random expression over the numbers."""
    for _ in range(10_000):
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        pool = list(numbers)
        while len(pool) > 1:
            a = pool.pop(rng.randrange(len(pool)))
            b = pool.pop(rng.randrange(len(pool)))
            a, b = max(a, b), min(a, b)  # intermediate values stay positive integers
            choices = [a + b, a * b] + ([a - b] if a != b else []) + ([a // b] if a % b == 0 else [])
            pool.append(rng.choice(choices))
        if 1 <= pool[0] <= max_target:
            return CountdownProblem(tuple(numbers), pool[0])
    raise ValueError(
        f"could not generate a target in 1..{max_target} from {num_numbers} numbers up to {max_number}"
    )


class CountdownAgent(RewardOnlyAgent):
    """Generated Countdown problems with the rule-based reward above."""

    def __init__(
        self,
        *,
        num_numbers: int = 4,
        max_number: int = 100,
        max_target: int = 100,
        num_problems: int = 10_000,
        problem_seed: int = 0,
        format_reward: float = 0.1,
        system_prompt: str | None = None,
        chat: bool = True,
        **kwargs: Any,
    ):
        """
        Args:
            num_numbers / max_number / max_target: size of the problems.
            num_problems: problems generated (duplicates removed); `eval_size` of them are held out.
            problem_seed: seed of the generated problem set (the run's `seed` only orders it).
            format_reward: reward of a tagged but wrong answer.
            system_prompt / chat: prompt form (chat messages for chat-tuned models, else plain text).
            **kwargs: `RewardOnlyAgent` options.
        """
        if not 2 <= num_numbers <= 6:
            raise ValueError(f"num_numbers must be in 2..6, got {num_numbers}")
        if max_number < 1 or max_target < 1 or num_problems < 1:
            raise ValueError("max_number, max_target and num_problems must be >= 1")
        super().__init__(**kwargs)
        self.num_numbers = num_numbers
        self.max_number = max_number
        self.max_target = max_target
        self.num_problems = num_problems
        self.problem_seed = problem_seed
        self.format_reward = format_reward
        self.system_prompt = system_prompt
        self.chat = chat

    def prompts(self) -> list[Problem]:
        rng = random.Random(f"countdown:{self.problem_seed}")
        problems: dict[str, Problem] = {}
        for _ in range(self.num_problems):
            task = generate_problem(
                rng, num_numbers=self.num_numbers, max_number=self.max_number, max_target=self.max_target
            )
            text = PROMPT.format(numbers=", ".join(map(str, task.numbers)), target=task.target)
            problem_id = f"{'_'.join(map(str, task.numbers))}->{task.target}"
            problems.setdefault(
                problem_id,
                Problem(
                    problem_id, make_prompt(text, system_prompt=self.system_prompt, chat=self.chat), task
                ),
            )
        return list(problems.values())

    def reward(self, response: InferenceResponse, problem: Problem) -> float:
        task: CountdownProblem = problem.answer
        return countdown_reward(response.text, task.numbers, task.target, format_reward=self.format_reward)
