"""TRL-style reward functions scored a group at a time: TRL's layout, async functions awaited
concurrently under `reward_concurrency`, synchronous ones off the event loop, failures at the user's
line, `batch: completion`, multi-turn groups and evaluation."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time

import pytest
from scripted_inference import ScriptedInference

from llmrl.agents.dataset import DatasetAgent
from llmrl.registry import import_plugins

ROWS = [{"question": f"What is 2 + {i}?", "solution": str(2 + i), "topic": "sums"} for i in range(12)]

REWARDS = """
import asyncio

CALLS = []


def record(prompts, completions, completion_ids, **columns):
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns})
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(text == s) for text, s in zip(texts, columns["solution"])]


IN_FLIGHT = [0, 0]  # now, most


async def slow(completions, **kwargs):
    IN_FLIGHT[0] += 1
    IN_FLIGHT[1] = max(IN_FLIGHT)
    await asyncio.sleep(0.2)
    IN_FLIGHT[0] -= 1
    return [1.0 for _ in completions]


def raises(completions, **kwargs):
    return [float(c) / 0 for c in completions]


def too_short(completions, **kwargs):
    return [1.0]


async def async_raises(completions, **kwargs):
    await asyncio.sleep(0)
    raise RuntimeError("judge unreachable")


async def hangs(completions, **kwargs):
    await asyncio.sleep(10)


def first_not_scored(completions, **kwargs):
    return [float("nan")] + [1.0] * (len(completions) - 1)
"""


class Plugin:
    def __init__(self, folder, name, source):
        self.path = folder / f"{name}.py"
        self.path.write_text(source)
        self.lines = source.splitlines()
        import_plugins([str(self.path)])
        self.module = sys.modules[name]

    def line(self, text: str) -> int:
        return next(number for number, line in enumerate(self.lines, 1) if text in line)


@pytest.fixture(scope="module")
def rewards(tmp_path_factory):
    yield Plugin(tmp_path_factory.mktemp("plugins"), "batched_rewards", REWARDS)
    sys.modules.pop("batched_rewards", None)


@pytest.fixture
def calls(rewards):
    rewards.module.CALLS.clear()
    return rewards.module.CALLS


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return str(path)


def agent(data_file, *entries, chat=False, **kwargs) -> DatasetAgent:
    functions = [{"function": f"batched_rewards:{e}"} if isinstance(e, str) else e for e in entries]
    return DatasetAgent(
        data_files=data_file,
        prompt_column="question",
        answer_column="solution",
        chat=chat,
        reward_functions=functions,
        eval_size=2,
        env_id="sums",
        **kwargs,
    )


def right_then_wrong(prompt: str, index: int) -> str:
    """The right sum to even samples, a wrong one to odd ones."""
    total = 2 + int(re.search(r"2 \+ (\d+)", prompt).group(1))
    return str(total if index % 2 == 0 else total + 1)


def draw(agent, groups, group_size, inference=None):
    inference = inference or ScriptedInference(right_then_wrong)
    return asyncio.run(agent.group_rollouts(inference, groups, group_size))


def test_a_trl_function_is_called_once_per_group_with_trls_layout(data_file, calls):
    groups = draw(agent(data_file, "record"), 3, 4)
    assert len(calls) == 3
    by_prompt = {call["prompts"][0]: call for call in calls}  # the groups' calls ran concurrently
    for group in groups:
        prompt = group.rollouts[0].text[0]
        call = by_prompt[prompt]
        total = str(2 + int(prompt.split("+ ")[1].rstrip("?")))
        assert call["prompts"] == [prompt] * 4  # repeated per completion, as TRL repeats them
        assert call["completions"] == [total, str(int(total) + 1)] * 2
        assert call["completion_ids"] == [list(r.trajectory[-1]) for r in group.rollouts]
        assert call["solution"] == [total] * 4 and call["topic"] == ["sums"] * 4  # the row's columns
        assert [r.reward for r in group.rollouts] == [1.0, 0.0, 1.0, 0.0]
        assert [r.reward_components for r in group.rollouts] == [{"record": 1.0}, {"record": 0.0}] * 2


def test_chat_prompts_and_completions_are_message_lists_as_in_trl(data_file, calls):
    (group,) = draw(agent(data_file, "record", chat=True), 1, 2)
    (call,) = calls
    (question,) = {m["content"] for m in call["prompts"][0]}
    assert call["prompts"] == [[{"role": "user", "content": question}]] * 2
    total = right_then_wrong(question, 0)
    assert call["completions"] == [
        [{"role": "assistant", "content": total}],
        [{"role": "assistant", "content": str(int(total) + 1)}],
    ]
    assert [r.reward for r in group.rollouts] == [1.0, 0.0]


def test_batch_completion_calls_once_per_completion(data_file, calls):
    groups = draw(agent(data_file, {"function": "batched_rewards:record", "batch": "completion"}), 2, 3)
    assert len(calls) == 6 and all(len(call["completions"]) == 1 for call in calls)
    assert [r.reward for g in groups for r in g.rollouts] == [1.0, 0.0, 1.0] * 2


def test_evaluation_scores_all_samples_of_a_problem_in_one_call(data_file, calls):
    response = asyncio.run(
        agent(data_file, "record").evaluate(
            ScriptedInference(right_then_wrong), 2, samples_per_prompt=3, greedy=True
        )
    )
    assert sorted(len(call["completions"]) for call in calls) == [1, 1, 3, 3]  # greedy: one sample
    assert [r.rewards for r in response.results] == [[1.0, 0.0, 1.0]] * 2


@pytest.mark.parametrize(("concurrency", "least_s", "most_s"), [(8, 0.2, 0.6), (2, 0.8, 1.4)])
def test_async_functions_overlap_across_groups_within_the_concurrency_limit(
    rewards, data_file, concurrency, least_s, most_s
):
    scoring = agent(data_file, "slow", reward_concurrency=concurrency)
    draw(scoring, 1, 2)  # warm: the first draw also builds the problem order
    rewards.module.IN_FLIGHT[:] = [0, 0]
    started = time.perf_counter()
    groups = draw(scoring, 8, 2)  # 8 groups, each one call of 0.2 s: 1.6 s one after another
    elapsed = time.perf_counter() - started
    assert [r.reward for g in groups for r in g.rollouts] == [1.0] * 16
    assert rewards.module.IN_FLIGHT[1] == concurrency
    assert least_s <= elapsed < most_s, elapsed


def test_synchronous_functions_never_block_the_event_loop(data_file):
    def sleepy(completions, **kwargs):
        time.sleep(0.3)
        return [1.0] * len(completions)

    scoring = agent(data_file, {"function": sleepy})
    ticks: list[float] = []

    async def both():
        async def tick():
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        groups = await scoring.group_rollouts(ScriptedInference("4"), 4, 2)
        ticker.cancel()
        return groups

    started = time.perf_counter()
    groups = asyncio.run(both())
    assert [r.reward for g in groups for r in g.rollouts] == [1.0] * 8
    assert time.perf_counter() - started < 0.3 * 4  # the groups' calls ran at once, in threads
    assert max(b - a for a, b in zip(ticks, ticks[1:], strict=False)) < 0.15  # the loop went on meanwhile


@pytest.mark.parametrize(
    ("function", "line", "detail", "failed"),
    [
        # A raise or a list of the wrong length fails the call's every completion.
        ("raises", "/ 0", "in raises: ZeroDivisionError: float division by zero", [0, 1, 2, 3]),
        (
            "async_raises",
            'raise RuntimeError("judge unreachable")',
            "in async_raises: RuntimeError: judge unreachable",
            [0, 1, 2, 3],
        ),
        (
            "too_short",
            "def too_short(",
            "in too_short: returned [1.0]; expected a list with one value per completion (4)",
            [0, 1, 2, 3],
        ),
        # A value that is not a number fails its completion only.
        (
            "first_not_scored",
            "def first_not_scored(",
            "in first_not_scored: returned nan; expected a finite number (or None: not scored)",
            [0],
        ),
    ],
)
def test_failures_name_the_users_line_once_per_step(
    rewards, data_file, caplog, function, line, detail, failed
):
    scoring = agent(data_file, function)
    with caplog.at_level(logging.WARNING):
        groups = draw(scoring, 2, 4)
    reason = f"reward: {rewards.path}:{rewards.line(line)} {detail}"
    for group in groups:
        assert [r.failure_reason for r in group.rollouts] == [
            reason if i in failed else None for i in range(4)
        ]
    count = 2 * len(failed)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"sums: {reason} (x{count} this step)"
    ]
    assert scoring.pop_metrics() == {"failures/reward": float(count), "placeholders": float(count)}


def test_a_call_over_its_time_limit_fails_its_rollouts(data_file):
    scoring = agent(data_file, "hangs", reward_timeout_s=0.1)
    started = time.perf_counter()
    groups = draw(scoring, 2, 3)
    assert time.perf_counter() - started < 1.0
    assert {r.failure_reason for g in groups for r in g.rollouts} == {"reward: timed out after 0.1 s"}
    assert scoring.pop_metrics() == {"failures/reward": 6.0, "placeholders": 6.0}


class Retrying(DatasetAgent):
    """Asks again until the reply is right, up to `max_turns`: a group's episodes end at different turns."""

    def observe(self, turn, response, problem):
        return None if response.text == problem.answer else "Try again."


def test_a_multi_turn_group_is_scored_once_all_its_episodes_are_done(data_file, calls):
    def reply(prompt: str, index: int) -> str:
        """Sample 0 is right at once; sample 1 only on its second try."""
        total = 2 + int(prompt.split("What is 2 + ")[1].split("?")[0])
        return str(total if index == 0 or prompt.endswith("Try again.") else total + 1)

    scoring = Retrying(
        data_files=data_file,
        prompt_column="question",
        answer_column="solution",
        chat=False,
        reward_functions=[{"function": "batched_rewards:record"}],
        eval_size=2,
        max_turns=3,
    )
    inference = ScriptedInference(reply)
    groups = draw(scoring, 2, 2, inference)
    assert len(calls) == 2 and all(len(call["completions"]) == 2 for call in calls)
    assert [len(r.trajectory) for g in groups for r in g.rollouts] == [2, 4] * 2  # 1 and 2 turns
    assert [r.reward for g in groups for r in g.rollouts] == [1.0] * 4
