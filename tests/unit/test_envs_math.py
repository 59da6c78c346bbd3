"""math / gsm8k: answer extraction and math-verify checking on hand-written answers; the shipped fixtures."""

import asyncio
import json
import re

import pytest
from scripted_inference import ScriptedInference

from llmrl.agents import evaluation_metrics
from llmrl.agents.dataset import packaged_data
from llmrl.envs.math import GSM8KAgent, MathAgent
from llmrl.rewards.answers import is_equivalent, math_reward


@pytest.mark.parametrize(
    "completion, reference, reward",
    [
        ("So the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("<answer>1+x</answer>", "x+1", 1.0),
        ("Total: 1,000 apples.\n#### 1,000", "1000", 1.0),
        ("#### 1000", "1,000", 1.0),
        ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
        ("\\boxed{36\\pi}", "36\\pi", 1.0),
        ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
        ("\\boxed{5}", "4", 0.0),
        ("\\boxed{36}", "36\\pi", 0.0),
        ("The answer is 4.", "4", 0.0),  # unmarked answers score nothing
        ("\\boxed{4", "4", 0.0),  # unclosed box
        ("<answer>-6</answer>", "-6", 1.0),
        ("<answer>6</answer>", "-6", 0.0),
    ],
)
def test_reward_table(completion, reference, reward):
    assert math_reward(completion, reference) == reward


def test_penalties_for_truncated_and_trailing_output():
    assert math_reward("\\boxed{4}", "4", truncated=True, truncation_penalty=0.5) == 0.5
    assert math_reward("no answer yet", "4", truncated=True, truncation_penalty=0.5) == -0.5
    assert math_reward("\\boxed{4} and more words", "4", trailing_penalty=0.25) == 0.75
    assert math_reward("\\boxed{4}.  \n", "4", trailing_penalty=0.25) == 0.75  # '.' is trailing text
    assert math_reward("\\boxed{4}  \n", "4", trailing_penalty=0.25) == 1.0
    assert math_reward("\\boxed{4} and more words", "4") == 1.0  # off by default


def test_unparseable_answers_fall_back_to_string_comparison():
    assert is_equivalent("\\text{Paris}", "\\text{Paris}")
    assert not is_equivalent("\\text{Paris}", "\\text{Rome}")


def test_gsm8k_fixture_is_consistent():
    # Every <<expression=value>> annotation is right and the final answer is the last value.
    for name in ("gsm8k_train.jsonl", "gsm8k_test.jsonl"):
        with open(packaged_data(name)) as f:
            rows = [json.loads(line) for line in f]
        for row in rows:
            annotations = re.findall(r"<<([^=<>]+)=([^<>]+)>>", row["answer"])
            assert annotations, row["question"]
            for expression, value in annotations:
                assert eval(expression, {"__builtins__": {}}) == float(value), expression  # our own fixture
            final = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
            assert float(final) == float(annotations[-1][1])


def test_gsm8k_agent_uses_the_shipped_fixture_and_scores_rollouts():
    agent = GSM8KAgent(chat=False)
    assert len(agent.train_problems) == 24 and len(agent.eval_problems) == 12
    answers = {p.prompt: p.answer for p in agent.train_problems + agent.eval_problems}
    assert all(re.fullmatch(r"[\d,]+", a) for a in answers.values())

    def reply(prompt, i):
        return f"Step by step... \\boxed{{{answers[prompt]}}}" if i == 0 else "\\boxed{-1}"

    groups = asyncio.run(agent.group_rollouts(ScriptedInference(reply), 4, 2))
    assert [g.rewards for g in groups] == [[1.0, 0.0]] * 4  # math-verify works in reward threads
    response = asyncio.run(agent.evaluate(ScriptedInference(reply), 12, samples_per_prompt=2))
    assert evaluation_metrics(response)["reward_mean"] == 0.5


def test_math_agent_extracts_the_boxed_reference_from_solutions():
    agent = MathAgent(eval_size=0)
    references = [p.answer for p in agent.eval_problems]
    assert "\\frac{5}{6}" in references and "-6" in references
    assert all("\\boxed" not in r for r in references)


def test_math_agent_validates_penalties():
    with pytest.raises(ValueError, match="truncation_penalty"):
        MathAgent(truncation_penalty=-1)
