"""The arithmetic task's problems, splits, prompts and scoring (llmrl/rewards/arithmetic.py)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from llmrl.rewards.arithmetic import (
    HELDOUT_FRACTION,
    ArithmeticProblem,
    iter_problems,
    prompt_messages,
    prompt_text,
    sample_problems,
    score,
)
from llmrl.types import ChatMessage


def take(n, **kwargs):
    return list(itertools.islice(iter_problems(**kwargs), n))


def test_problem_of_fills_id_and_answer():
    assert ArithmeticProblem.of(23, "+", 45) == ArithmeticProblem("23+45", 23, 45, "+", 68)
    assert ArithmeticProblem.of(12, "*", 11).answer == 132


def test_problem_is_frozen():
    problem = ArithmeticProblem.of(1, "+", 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.a = 5  # type: ignore[misc]


def test_stream_is_seeded_and_seeds_differ():
    assert take(50, seed=3) == take(50, seed=3)
    assert take(50, seed=3) != take(50, seed=4)


@pytest.mark.parametrize("digits, low, high", [(1, 0, 9), (2, 10, 99), (3, 100, 999)])
def test_operands_have_exactly_the_requested_digits(digits, low, high):
    problems = take(300, digits=digits)
    assert all(low <= p.a <= high and low <= p.b <= high for p in problems)
    # The whole range is used, not a corner of it.
    assert (
        min(p.a for p in problems) < low + (high - low) // 4
        and max(p.a for p in problems) > high - (high - low) // 4
    )


def test_answers_are_right_for_both_ops():
    problems = take(200, ops=("+", "*"))
    assert {p.op for p in problems} == {"+", "*"}
    for p in problems:
        assert p.answer == (p.a + p.b if p.op == "+" else p.a * p.b)
        assert p.problem_id == f"{p.a}{p.op}{p.b}"


def test_ops_selection_is_respected():
    assert {p.op for p in take(100, ops=("*",))} == {"*"}


def test_splits_never_overlap_whatever_the_seeds():
    train = {p.problem_id for p in take(3000, split="train", seed=1)}
    test = {p.problem_id for p in take(300, split="test", seed=2)}
    assert len(test) > 150 and train.isdisjoint(test)
    assert all(p.split == "test" for p in take(300, split="test", seed=2))


def test_heldout_share_matches_the_fraction():
    everything = [ArithmeticProblem.of(a, "+", b) for a in range(10, 100) for b in range(10, 100)]
    share = sum(p.split == "test" for p in everything) / len(everything)
    assert abs(share - HELDOUT_FRACTION) < 0.02


def test_sample_problems_are_distinct_seeded_and_in_split():
    problems = sample_problems(256, split="test", seed=7)
    assert len({p.problem_id for p in problems}) == 256
    assert all(p.split == "test" for p in problems)
    assert problems == sample_problems(256, split="test", seed=7)
    assert problems != sample_problems(256, split="test", seed=8)


def test_sample_problems_rejects_impossible_counts():
    with pytest.raises(ValueError, match="count must be between 0 and"):
        sample_problems(100, digits=1, split="test")
    with pytest.raises(ValueError, match="count"):
        sample_problems(-1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"digits": 0}, "digits"),
        ({"digits": 2.5}, "digits"),
        ({"ops": ("-",)}, "ops"),
        ({"ops": ()}, "ops"),
        ({"split": "validation"}, "split"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, field):
    with pytest.raises(ValueError, match=field):
        next(iter_problems(**kwargs))
    with pytest.raises(ValueError, match=field):
        sample_problems(1, **kwargs)


def test_prompt_is_short_and_a_single_user_turn():
    problem = ArithmeticProblem.of(23, "+", 45)
    assert prompt_text(problem) == "What is 23 + 45?"
    assert prompt_messages(problem) == [ChatMessage(role="user", content="What is 23 + 45?")]


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("68", 1.0),
        ("  68\n", 1.0),
        ("68<|im_end|>", 1.0),
        ("The answer is 68.", 1.0),
        ("68 apples, or 70", 1.0),
        ("69", 0.0),
        ("6 8", 0.0),
        ("680", 0.0),
        ("-68", 0.0),
        ("70 or 68", 0.0),
        ("", 0.0),
        ("sixty-eight", 0.0),
    ],
)
def test_score_reads_the_first_integer(completion, reward):
    assert score(completion, ArithmeticProblem.of(23, "+", 45)) == reward
