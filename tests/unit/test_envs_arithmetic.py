"""ArithmeticAgent: the built-in task's splits as an agent, its reward on hand-written answers, a real
engine."""

import asyncio

import pytest
from scripted_inference import ScriptedInference

from llmrl.envs.arithmetic import ArithmeticAgent, ArithmeticProblem
from llmrl.types import GenerationArgs, InferenceResponse


def respond(text):
    return InferenceResponse(text=text, prompt_token_ids=[1], token_ids=[2], finish_reason="stop")


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("133", 1.0),
        (" 133 because 87 + 46 = 133", 1.0),
        ("133.", 1.0),
        ("134", 0.0),
        ("one hundred", 0.0),
        ("", 0.0),
    ],
)
def test_reward_table(completion, reward):
    agent = ArithmeticAgent(eval_size=4)
    problem = next(p for p in agent.train_problems + agent.eval_problems if p.id == "87+46")
    assert agent.reward(respond(completion), problem) == reward


def test_splits_follow_the_problems_own_split():
    agent = ArithmeticAgent(digits=2, ops=["+", "*"], eval_size=64)
    assert {p.answer.split for p in agent.train_problems} == {"train"}
    assert {p.answer.split for p in agent.eval_problems} == {"test"}
    assert len(agent.eval_problems) == 64
    # Every training problem of the split, once: 2 ops x 90 x 90 operands, 10% held out.
    assert len(agent.train_problems) == len({p.id for p in agent.train_problems}) > 0.85 * 2 * 90 * 90
    assert agent.eval_problems[0].prompt[-1].content.startswith("What is ")


def test_small_and_large_problem_spaces():
    one_digit = ArithmeticAgent(digits=1, eval_size=64)
    assert len(one_digit.eval_problems) + len(one_digit.train_problems) == 100  # all of them, split
    three = ArithmeticAgent(digits=3, num_problems=500, eval_size=10)
    assert len(three.train_problems) == 500 and all(p.answer.split == "train" for p in three.train_problems)


def test_rollouts_with_a_model_that_adds():
    def reply(prompt, i):
        a, b = prompt.rsplit("What is ", 1)[1].split("?")[0].split(" + ")
        return str(int(a) + int(b) + i)  # sample 0 right, the others off by i

    agent = ArithmeticAgent(eval_size=8, seed=3)
    groups = asyncio.run(agent.group_rollouts(ScriptedInference(reply), 4, 3))
    assert [g.rewards for g in groups] == [[1.0, 0.0, 0.0]] * 4
    assert all(ArithmeticProblem.of(*_operands(g.rollouts[0].problem_id)).split == "train" for g in groups)


def _operands(problem_id):
    a, b = problem_id.split("+")
    return int(a), "+", int(b)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"digits": 0}, "digits"), ({"ops": ["-"]}, "ops"), ({"num_problems": 0}, "num_problems")],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticAgent(**kwargs)


@pytest.mark.slow
def test_rollouts_from_the_embedded_engine_carry_its_exact_tokens():
    from llmrl.inference.engine import LocalEngine
    from llmrl.models.tiny import TinyRecipe
    from llmrl.models.tiny_build import build_tokenizer, build_untrained_model

    recipe = TinyRecipe()
    tokenizer = build_tokenizer(recipe)
    engine = LocalEngine(build_untrained_model(recipe, tokenizer), tokenizer, seed=0, policy_version=2)
    agent = ArithmeticAgent(eval_size=8)
    groups = asyncio.run(agent.group_rollouts(engine, 3, 4, GenerationArgs(max_tokens=6)))
    assert len(groups) == 3
    # One request per group: each prompt was prefilled once for its 4 samples, and the 12
    # sequences were decoded together, several rows per step.
    assert engine.stats.prefill_tokens == sum(len(g.rollouts[0].trajectory[0]) for g in groups)
    assert engine.stats.decode_tokens > 2 * engine.stats.steps
    for group in groups:
        problem = next(p for p in agent.train_problems if p.id == group.rollouts[0].problem_id)
        messages = [m.model_dump() for m in problem.prompt]
        expected_prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for rollout in group.rollouts:
            assert rollout.status == "ok" and rollout.policy_version == 2
            assert rollout.trajectory[0] == list(expected_prompt)
            assert 1 <= len(rollout.trajectory[1]) <= 6 and all(rollout.generation_mask[1])
            assert all(lp <= 0 for lp in rollout.logprobs[1])
