"""The dataset agent on verl's and TRL's layouts: detection, struct column paths, rewards, clear errors."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pandas
import pytest
import torch
from scripted_inference import ScriptedInference

from llmrl import registry
from llmrl.agents.dataset import DatasetAgent, load_rows
from llmrl.errors import shown_path
from llmrl.rollouts import rollout_metrics
from llmrl.types import ChatMessage, InferenceResponse

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "layouts"
VERL = {
    "data_files": str(FIXTURES / "verl_train.parquet"),
    "eval_data_files": str(FIXTURES / "verl_test.parquet"),
}
TRL = {"data_files": str(FIXTURES / "trl_train.jsonl"), "eval_data_files": str(FIXTURES / "trl_test.jsonl")}


@pytest.fixture
def fixture_plugins(monkeypatch):
    """The fixtures' reward functions, imported as a config's plugins: entry would."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.setattr(registry, "_plugin_modules", set())
    registry.import_plugins(["arithmetic_rewards"])
    yield
    monkeypatch.delitem(sys.modules, "arithmetic_rewards")


def answer_sums(prompt, i):
    """Replies with the right sum to even samples and a wrong one to odd ones."""
    a, b = (int(x) for x in re.search(r"What is (\d+) \+ (\d+)\?", prompt).groups())
    return str(a + b + i % 2)


def rollouts(agent, groups=4, group_size=2):
    return [
        r
        for g in asyncio.run(agent.group_rollouts(ScriptedInference(answer_sums), groups, group_size))
        for r in g.rollouts
    ]


def test_the_fixtures_are_what_write_fixtures_writes(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    import write_fixtures

    for split in ("train", "test"):
        assert load_rows(data_files=str(FIXTURES / f"verl_{split}.parquet")) == write_fixtures.verl_rows(
            split
        )
        assert load_rows(data_files=str(FIXTURES / f"trl_{split}.jsonl")) == write_fixtures.trl_rows(split)


def test_verl_layout_is_detected_and_scored_by_data_source():
    agent = DatasetAgent(**VERL, system_prompt="Be brief.")
    assert agent.layout == "verl" and agent.answer_column == "reward_model.ground_truth"
    problem = agent.train_problems[0]
    assert problem.prompt == [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="What is 47 + 12?"),
    ]
    assert problem.answer == "59"
    scored = rollouts(agent)
    assert [r.reward for r in scored] == [1.0, 0.0] * 4  # default_compute_score routes "arithmetic"
    assert [r.reward_components for r in scored[:2]] == [{"score": 1.0}, {"score": 0.0}]


def test_conversational_layout_keeps_the_datas_own_system_message(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Answer in digits."},
                {"role": "user", "content": f"{i}+{i}?"},
            ],
            "answer": str(2 * i),
        }
        for i in range(10)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    agent = DatasetAgent(data_files=str(path), system_prompt="ignored: the data has one", eval_size=2)
    assert agent.layout == "conversational"
    assert [m.role for m in agent.train_problems[0].prompt] == ["system", "user"]
    assert agent.train_problems[0].prompt[0].content == "Answer in digits."


def test_trl_reward_functions_from_a_plugin_with_weights_and_per_function_metrics(fixture_plugins):
    agent = DatasetAgent(
        **TRL,
        env_id="sums",
        reward_functions=[
            {"function": "arithmetic_rewards:correct_sum", "weight": 1.0},
            {"function": "arithmetic_rewards:short_reply", "weight": 0.1},
        ],
    )
    assert (
        agent.layout == "conversational" and agent.answer_column is None
    )  # no answer column: functions need none
    scored = rollouts(agent)
    assert [r.reward for r in scored] == [1.1, 0.1] * 4
    assert scored[0].reward_components == {"correct_sum": 1.0, "short_reply": 1.0}
    groups = asyncio.run(agent.group_rollouts(ScriptedInference(answer_sums), 4, 2))
    metrics = rollout_metrics(groups, torch.zeros(8), correct_threshold=1.0)
    assert metrics["reward/sums/correct_sum"] == 0.5 and metrics["reward/sums/short_reply"] == 1.0


def test_a_verl_file_with_a_trl_function_reading_a_struct_column(fixture_plugins):
    agent = DatasetAgent(
        **VERL, reward_functions=[{"function": "arithmetic_rewards:correct_sum_from_reward_model"}]
    )
    assert [r.reward for r in rollouts(agent)] == [1.0, 0.0] * 4


def test_math_verify_in_a_reward_function_needs_its_signal_timeouts_off():
    """Reward functions run in worker threads (never blocking generation), where math-verify's default
    SIGALRM timeouts cannot work: such a function fails at its line with math-verify's advice, and
    scores with the timeouts off (as TRL's own accuracy reward turns them off in a thread)."""
    from math_verify import parse, verify

    def accuracy(completions, solution, **kwargs):
        return [
            float(verify(parse(s), parse(c[0]["content"])))
            for c, s in zip(completions, solution, strict=True)
        ]

    def accuracy_without_timeouts(completions, solution, **kwargs):
        return [
            float(
                verify(
                    parse(s, parsing_timeout=None),
                    parse(c[0]["content"], parsing_timeout=None),
                    timeout_seconds=None,
                )
            )
            for c, s in zip(completions, solution, strict=True)
        ]

    failed = rollouts(DatasetAgent(**TRL, reward_functions=[{"function": accuracy}]))
    (reason,) = {r.failure_reason for r in failed}
    where = f"{shown_path(__file__)}:{accuracy.__code__.co_firstlineno + 2} in {accuracy.__qualname__}"
    assert reason.startswith(f"reward: {where.replace('.<locals>', '')}: ValueError: Math-Verify")
    assert "set the parsing_timeout=None" in reason
    agent = DatasetAgent(**TRL, reward_functions=[{"function": accuracy_without_timeouts}])
    assert [r.reward for r in rollouts(agent)] == [1.0, 0.0] * 4


def test_a_raising_reward_function_makes_a_placeholder(tmp_path):
    def broken(completions, **kwargs):
        raise RuntimeError("no reward today")

    agent = DatasetAgent(**TRL, reward_functions=[{"function": broken}])
    scored = rollouts(agent, groups=1)
    assert all(r.status == "placeholder" and "no reward today" in r.failure_reason for r in scored)
    assert agent.pop_metrics()["failures/reward"] == 2


def test_struct_paths_work_in_the_flat_layout_and_format_overrides_detection(tmp_path):
    path = tmp_path / "flat.parquet"
    pandas.DataFrame(
        [
            {"question": f"{i} + {i}?", "meta": {"gold": {"value": str(2 * i)}}, "data_source": "gsm8k"}
            for i in range(6)
        ]
    ).to_parquet(path)
    agent = DatasetAgent(
        data_files=str(path), prompt_column="question", answer_column="meta.gold.value", eval_size=1
    )
    assert agent.layout == "flat" and {p.answer for p in agent.train_problems} <= {
        "0",
        "2",
        "4",
        "6",
        "8",
        "10",
    }
    response = InferenceResponse(text="\\boxed{4}", prompt_token_ids=[1], token_ids=[2], finish_reason="stop")
    problem = next(p for p in agent.train_problems + agent.eval_problems if p.answer == "4")
    assert agent.reward(response, problem) == 1.0
    scored = DatasetAgent(
        data_files=str(path),
        prompt_column="question",
        answer_column="meta.gold.value",
        eval_size=1,
        reward_functions=[{"function": "default_compute_score"}],
    )
    assert scored.reward(response, problem).value == 1.0  # data_source gsm8k: llmrl's math reward
    with pytest.raises(
        ValueError,
        match=r"flat\.parquet: prompt_column='question' holds str '0 \+ 0\?'; the "
        r"conversational layout needs a non-empty list of \{role, content\} messages",
    ):
        DatasetAgent(
            data_files=str(path),
            prompt_column="question",
            answer_column="meta.gold.value",
            format="conversational",
            eval_size=1,
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"answer_column": "reward_model.answer"},
            r"verl_train\.parquet: answer_column='reward_model\.answer': the struct 'reward_model' has no field "
            r"'answer', only \['style', 'ground_truth'\]; the data's columns are \['data_source', 'prompt', 'ability', "
            r"'reward_model', 'extra_info'\]",
        ),
        (
            {"answer_column": "ability.name"},
            r"answer_column='ability\.name': 'ability' holds str 'math', not a struct",
        ),
        (
            {"prompt_column": "question"},
            r"verl_train\.parquet: prompt_column='question': not a column; the data's columns are \['data_source'",
        ),
        (
            {"prompt_template": "Solve: {prompt}"},
            r"prompts are chat messages \(verl layout\).*prompt_template",
        ),
        ({"format": "yaml"}, r"format: expected one of \['auto', 'flat', 'conversational', 'verl'\]"),
        (
            {"reward_functions": [{"function": lambda completions, solution: [1.0]}]},
            r"needs the column\(s\) \['solution'\], which the data lacks; its columns are \['data_source'",
        ),
    ],
)
def test_errors_name_the_file_the_column_and_what_was_found(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DatasetAgent(**VERL, **kwargs)


def test_prompts_that_are_not_messages_name_the_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "1"})
        + "\n"
        + json.dumps({"prompt": [{"role": "wizard", "content": "hi"}], "answer": "1"})
        + "\n"
    )
    agent = DatasetAgent(data_files=str(path), eval_size=0)
    with pytest.raises(
        ValueError,
        match=r"bad\.jsonl: row 1, column 'prompt': not chat messages \(role: Input should be .*wizard",
    ):
        agent.check_problems()


def test_subclasses_with_their_own_reward_refuse_reward_functions():
    from llmrl.envs.math import GSM8KAgent

    with pytest.raises(ValueError, match="GSM8KAgent has a reward of its own"):
        GSM8KAgent(reward_functions=[{"function": "default_compute_score"}])
