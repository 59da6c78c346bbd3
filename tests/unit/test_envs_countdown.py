"""Countdown: the reward table on hand-written answers, safe evaluation, solvable generated problems."""

import asyncio
import itertools
import random
from fractions import Fraction

import pytest
from scripted_inference import ScriptedInference

from llmrl.envs.countdown import CountdownAgent, generate_problem
from llmrl.rewards.countdown import countdown_reward, evaluate_expression

NUMBERS = (3, 7, 25, 50)
TARGET = 82  # (50 - 25) * 3 + 7


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("<answer>(50 - 25) * 3 + 7</answer>", 1.0),
        ("<think>25 * 3 = 75, 75 + 7 = 82</think>\n<answer> 7 + 3 * (50 - 25) </answer>", 1.0),
        ("<answer>(50 - 25) * 3 + 7 = 82</answer>", 1.0),  # a trailing '= target' is fine
        ("<answer>1 + 1</answer> no wait <answer>(50-25)*3+7</answer>", 1.0),  # the last answer counts
        ("<answer>(50 - 25) * 3 + 8</answer>", 0.1),  # 8 is not given
        ("<answer>(50 - 25) * 3</answer>", 0.1),  # 75, and 7 unused
        ("<answer>50 + 25 + 7</answer>", 0.1),  # 82, but 3 unused: all numbers must be used
        ("<answer>50 + 25 + 7 * 3 / 3</answer>", 0.1),  # 82, but 3 used twice
        ("<answer>(50 - 25) * 3 + 7 + 0</answer>", 0.1),  # an extra number
        ("<answer>(50 - 25) * 3 - 7</answer>", 0.1),  # right numbers, wrong value
        ("<answer>50 / (7 - 7) + 3 + 25</answer>", 0.1),  # division by zero
        ("<answer>-3 + 7 + 25 + 50</answer>", 0.1),  # unary minus is not an allowed operation
        ("<answer>__import__('os').system('id')</answer>", 0.1),  # never evaluated
        ("<answer>2 ** 10 ** 10</answer>", 0.1),  # no powers (this one would hang a plain eval)
        ("<answer>(50 - 25) * 3 + 7.0</answer>", 0.1),  # float literals are not the given integers
        ("<answer></answer>", 0.1),
        ("(50 - 25) * 3 + 7", 0.0),  # no tags: no format reward
        ("<answer>(50 - 25) * 3 + 7", 0.0),  # unclosed tag
    ],
)
def test_reward_table(completion, reward):
    assert countdown_reward(completion, NUMBERS, TARGET) == reward


def test_format_reward_is_configurable():
    assert countdown_reward("<answer>1</answer>", NUMBERS, TARGET, format_reward=0.0) == 0.0


def test_expressions_are_evaluated_exactly():
    assert evaluate_expression("1/3 + 2/3") == (Fraction(1), [1, 3, 2, 3])
    assert evaluate_expression("(7 - 3) * (25 / 50)") == (Fraction(2), [7, 3, 25, 50])
    assert evaluate_expression("x + 1") is None
    assert evaluate_expression("1 +") is None
    assert evaluate_expression("(" * 150 + "1" + ")" * 150) is None  # longer than the limit


def solvable(numbers, target):
    """Brute force: can all `numbers` be combined with + - * / into `target`?"""
    if len(numbers) == 1:
        return numbers[0] == target
    for i, j in itertools.permutations(range(len(numbers)), 2):
        a, b = numbers[i], numbers[j]
        rest = [n for k, n in enumerate(numbers) if k not in (i, j)]
        results = [a + b, a - b, a * b] + ([a / b] if b != 0 else [])
        if any(solvable([*rest, r], target) for r in results):
            return True
    return False


def test_generated_problems_are_solvable_and_in_range():
    rng = random.Random(0)
    for _ in range(20):
        problem = generate_problem(rng, num_numbers=4, max_number=50, max_target=100)
        assert len(problem.numbers) == 4 and all(1 <= n <= 50 for n in problem.numbers)
        assert 1 <= problem.target <= 100
        assert solvable([Fraction(n) for n in problem.numbers], problem.target)


def test_agent_prompts_and_rewards():
    agent = CountdownAgent(num_problems=300, eval_size=20, chat=False, seed=1)
    other_seed = CountdownAgent(num_problems=300, eval_size=20, chat=False, seed=2)
    assert [p.id for p in agent.eval_problems] == [p.id for p in other_seed.eval_problems]
    problem = agent.train_problems[0]
    numbers, target = problem.answer.numbers, problem.answer.target
    assert f"equals {target}" in problem.prompt and ", ".join(map(str, numbers)) in problem.prompt

    solutions = {}

    def reply(prompt, i):
        p = next(p for p in agent.train_problems if p.prompt == prompt)
        if p.id not in solutions:
            solutions[p.id] = find_expression(list(p.answer.numbers), p.answer.target)
        return f"<answer>{solutions[p.id]}</answer>" if i == 0 else "<answer>1 + 1</answer>"

    groups = asyncio.run(agent.group_rollouts(ScriptedInference(reply), 3, 2))
    assert [g.rewards for g in groups] == [[1.0, 0.1]] * 3


def find_expression(numbers, target):
    """An expression string over `numbers` equal to `target` (brute force, for the test's model)."""
    items = [(Fraction(n), str(n)) for n in numbers]

    def search(items):
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i, j in itertools.permutations(range(len(items)), 2):
            (a, sa), (b, sb) = items[i], items[j]
            rest = [x for k, x in enumerate(items) if k not in (i, j)]
            options = [(a + b, f"({sa} + {sb})"), (a - b, f"({sa} - {sb})"), (a * b, f"({sa} * {sb})")]
            if b != 0:
                options.append((a / b, f"({sa} / {sb})"))
            for option in options:
                found = search([*rest, option])
                if found:
                    return found
        return None

    return search(items)
