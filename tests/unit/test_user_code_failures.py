"""The user's own code failing: reward functions that return no number (a string, NaN, None for every
completion) and agent programs that raise or never call the model fail their rollouts with the file
and line to fix, are logged once per step with a count, and a run they break stops in one line."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest

from llmrl import cli
from llmrl.agents import WeightedMultiTask, placeholder_rollout
from llmrl.agents.dataset import DatasetAgent
from llmrl.agents.openai_agent import OpenAIAgent
from llmrl.errors import UserCodeError
from llmrl.registry import import_plugins
from llmrl.rollouts import RolloutBank, RolloutPipeline, UserCodeFailures
from llmrl.types import GenerationArgs, RolloutGroup, TokenRollout
from tests.unit.scripted_inference import EchoAgent, ScriptedInference, answer_of

REWARDS = """
def str_fn(completions, **kwargs):
    return ["1.0" for _ in completions]


def nan_fn(completions, **kwargs):
    return [float("nan") for _ in completions]


def none_fn(completions, **kwargs):
    return [None for _ in completions]


def length(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def second_number(text):
    return int(text.split()[1])


def parsing_fn(completions, **kwargs):
    return [float(second_number(c[0]["content"])) for c in completions]


def text_fn(completions, **kwargs):  # conversational completions are message lists, not text
    return [1.0 if c.startswith("4") else 0.0 for c in completions]
"""

PROGRAMS = """
async def typo(client, problem):
    messages = [{"role": "user", "content": problem["questoin"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    return float(reply.choices[0].message.content == "4")


async def never_calls(client, problem):
    return 1.0
"""


class Plugin:
    """A plug-in module written to a file and imported as a config's `plugins:` imports it."""

    def __init__(self, folder: Path, name: str, source: str):
        self.path = folder / f"{name}.py"
        self.path.write_text(source)
        self.lines = source.splitlines()
        import_plugins([str(self.path)])
        self.name = name

    def line(self, text: str) -> int:
        """The line number of the first line of the module that holds `text`."""
        return next(number for number, line in enumerate(self.lines, 1) if text in line)


@pytest.fixture(scope="module")
def rewards(tmp_path_factory):
    yield Plugin(tmp_path_factory.mktemp("plugins"), "user_code_rewards", REWARDS)
    sys.modules.pop("user_code_rewards", None)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    yield Plugin(tmp_path_factory.mktemp("plugins"), "user_code_programs", PROGRAMS)
    sys.modules.pop("user_code_programs", None)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is 2 + {i}?"}) + "\n" for i in range(12)))
    return str(path)


def dataset_agent(data_file: str, *functions: str) -> DatasetAgent:
    entries = [{"function": f"user_code_rewards:{name}"} for name in functions]
    return DatasetAgent(
        data_files=data_file, prompt_column="question", reward_functions=entries, eval_size=2, env_id="sums"
    )


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def reasons(groups: list[RolloutGroup]) -> list[str | None]:
    return [r.failure_reason for g in groups for r in g.rollouts]


# ---- reward functions ----------------------------------------------------------------------------


NOT_A_NUMBER = "expected a finite number (or None: not scored)"


@pytest.mark.parametrize(
    ("function", "line", "where", "detail"),
    [  # what it returned: where it is defined
        ("str_fn", "def str_fn(", "str_fn", f"returned '1.0'; {NOT_A_NUMBER}"),
        ("nan_fn", "def nan_fn(", "nan_fn", f"returned nan; {NOT_A_NUMBER}"),
        (
            "none_fn",
            "def none_fn(",
            "none_fn",
            "returned None (not scored) and no other reward function scored the completion: it has no reward",
        ),
        # what it raised: the line that raised, and the function called when that is another one
        (
            "parsing_fn",
            "return int(",
            "second_number (called by parsing_fn)",
            "IndexError: list index out of range",
        ),
        (
            "text_fn",
            'c.startswith("4")',
            "text_fn",
            "AttributeError: 'list' object has no attribute 'startswith'",
        ),
    ],
)
def test_a_failing_reward_function_fails_its_rollouts_at_its_line_logged_once_per_step(
    rewards, data_file, caplog, function, line, where, detail
):
    agent = dataset_agent(data_file, function)
    with caplog.at_level(logging.WARNING):
        groups = asyncio.run(agent.group_rollouts(ScriptedInference("four"), 3, 4))
    reason = f"reward: {rewards.path}:{rewards.line(line)} in {where}: {detail}"
    assert reasons(groups) == [reason] * 12
    assert warnings(caplog) == [f"sums: {reason} (x12 this step)"]
    assert agent.pop_metrics() == {"failures/reward": 12.0, "placeholders": 12.0}


def test_none_is_not_scored_when_another_function_scores_the_completion(rewards, data_file):
    agent = dataset_agent(data_file, "none_fn", "length")
    groups = asyncio.run(agent.group_rollouts(ScriptedInference("4 or 5"), 2, 2))
    assert [(r.status, r.reward, r.reward_components) for g in groups for r in g.rollouts] == [
        ("ok", 6.0, {"length": 6.0})
    ] * 4


def test_each_step_logs_its_failures_once_dynamic_sampling_rounds_included(rewards, data_file, caplog):
    agents = WeightedMultiTask(
        [dataset_agent(data_file, "str_fn")], [1.0], dynamic_sampling=True, max_resample_rounds=2
    )
    inference = ScriptedInference("4")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            asyncio.run(agents.group_rollouts(inference, 2, 2))
    reason = f"reward: {rewards.path}:{rewards.line('def str_fn(')} in str_fn: returned '1.0'; {NOT_A_NUMBER}"
    # Each step: 2 groups of 2, drawn again twice because failed groups carry no signal.
    assert warnings(caplog) == [f"sums: {reason} (x12 this step)"] * 2


# ---- agent programs ------------------------------------------------------------------------------


def program_agent(data_file: str, program: str) -> OpenAIAgent:
    return OpenAIAgent(
        rollout=f"user_code_programs:{program}",
        model_spec="tiny://arithmetic",
        data_files=data_file,
        eval_size=2,
        env_id="programs",
    )


@pytest.mark.parametrize(
    ("program", "line", "detail"),
    [
        ("typo", 'problem["questoin"]', "KeyError: 'questoin'"),
        (
            "never_calls",
            "def never_calls(",
            "made no model call that was answered, so there is nothing to train on",
        ),
    ],
)
def test_a_failing_program_is_named_at_its_line_and_logged_once_per_step(
    programs, data_file, caplog, program, line, detail
):
    agent = program_agent(data_file, program)
    inference = ScriptedInference("4")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            groups = asyncio.run(agent.group_rollouts(inference, 2, 3, GenerationArgs(max_tokens=4)))
    reason = f"program: {programs.path}:{programs.line(line)} in {program}: {detail}"
    assert reasons(groups) == [reason] * 6
    assert warnings(caplog) == [f"programs: {reason} (x6 this step)"] * 2
    assert inference.requests == []
    assert agent.pop_metrics() == {"failures/program": 12.0, "placeholders": 12.0}


# ---- stopping the run ----------------------------------------------------------------------------


def batch(ok: int, failed: int, reason: str = "reward: my.py:3 in f: returned '1.0'") -> list[RolloutGroup]:
    rollouts = [
        TokenRollout(trajectory=[[1], [2]], generation_mask=[[False], [True]], env_id="e", problem_id="p")
        for _ in range(ok)
    ] + [placeholder_rollout("e", "p", reason) for _ in range(failed)]
    return [RolloutGroup(group_id="g", rollouts=rollouts)]


def test_a_batch_whose_rollouts_all_failed_in_user_code_stops_at_once():
    failures = UserCodeFailures(None)
    assert failures.stop_line(1, batch(1, 7)) is None
    assert failures.stop_line(2, batch(0, 8)) == (
        "user code failed in all 8 rollouts of step 2; step 2 was not trained on (fix the code and rerun "
        "the same command to resume); most often, 8 times: e: reward: my.py:3 in f: returned '1.0'"
    )
    inference = batch(0, 8, reason="inference: ConnectError: refused")
    assert UserCodeFailures(None).stop_line(1, inference) is None  # not the user's code


def test_the_share_of_user_code_failures_over_the_last_three_steps_stops_the_run():
    failures = UserCodeFailures(0.5)
    assert failures.stop_line(1, batch(2, 6)) is None  # 75%, but one step is not yet a trend
    assert failures.stop_line(2, batch(6, 2)) is None
    assert failures.stop_line(3, batch(6, 2)) is None  # 10 of 24
    assert failures.stop_line(4, batch(1, 7)) is None  # steps 2-4: 11 of 24
    other = "reward: my.py:9 in g: KeyError: 'x'"
    assert failures.stop_line(5, batch(2, 6, reason=other)) == (
        "user code failed in 15 of 24 rollouts of steps 3-5 (more than training.max_user_failure_frac=0.5); "
        "step 5 was not trained on (fix the code and rerun the same command to resume); most often, "
        "9 times: e: reward: my.py:3 in f: returned '1.0'"
    )


class BreakableAgent(EchoAgent):
    """EchoAgent whose reward raises once `broken` is set."""

    broken = False

    def reward(self, response, problem):
        if self.broken:
            raise KeyError("answr")
        return super().reward(response, problem)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_batch_broken_by_user_code_is_refused_and_not_banked(tmp_path, lag):
    agent = BreakableAgent(env_id="echo", seed=0, eval_size=4)
    bank = RolloutBank(tmp_path)
    pipeline = RolloutPipeline(
        WeightedMultiTask([agent], [1.0]),
        ScriptedInference(lambda prompt, index: answer_of(prompt)),
        num_groups=2,
        group_size=2,
        generation_args=lambda step: GenerationArgs(),
        lag=lag,
        last_step=5,
        bank=bank,
        max_user_failure_frac=0.5,
    )
    try:
        pipeline.start(0)
        assert len(pipeline.get(1)) == 2
        pipeline.wait_ahead()
        BreakableAgent.broken = True  # the batch drawn next (2 without a lag, 3 with one) fails
        pipeline.submit_ahead(1)
        with pytest.raises(
            UserCodeError, match=r"user code failed in all 4 rollouts of step \d.*KeyError: 'answr'"
        ):
            pipeline.wait_ahead() if lag else pipeline.get(2)
        assert [b.step for b in bank.read()] == ([1] if lag == 0 else [1, 2])
    finally:
        BreakableAgent.broken = False
        pipeline.close()


def test_llmrl_train_stops_in_one_line_with_exit_1_before_checkpointing(
    rewards, data_file, tmp_path, capsys, tiny_model_path
):
    config = tmp_path / "run.yaml"
    config.write_text(
        textwrap.dedent(f"""
        run_dir: {tmp_path / "run"}
        model: {{spec: "tiny://arithmetic"}}
        plugins: [{rewards.path}]
        environments:
          - agent_type: dataset
            env_id: sums
            agent_args:
              data_files: {data_file}
              prompt_column: question
              eval_size: 2
              reward_functions: [{{function: "user_code_rewards:str_fn"}}]
        inference: {{generation: {{max_tokens: 4}}}}
        training: {{steps: 2, prompts_per_step: 2, group_size: 2}}
        evaluation: {{at_start: false, every: 0, num_prompts: 2, samples_per_prompt: 1, ks: [1]}}
        checkpoint: {{every: 1}}
        logging: {{progress: off, tensorboard: false, trace: false}}
        """)
    )
    assert cli.main(["train", str(config)]) == cli.EXIT_FAILED == 1
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llmrl")]
    assert ours == [
        "llmrl train: stopped: user code failed in all 4 rollouts of step 1; step 1 was not trained on "
        "(fix the code and rerun the same command to resume); most often, 4 times: sums: reward: "
        f"{rewards.path}:{rewards.line('def str_fn(')} in str_fn: returned '1.0'; expected a finite "
        "number (or None: not scored)"
    ]
    assert not list((tmp_path / "run").glob("checkpoints/*"))
