"""reasoning-gym's tasks as an environment, with the real library: rewards equal the library's own scores,
the draws are deterministic and held out, a mix follows its weights and logs each task, and mistakes are
one line."""

import asyncio
import sys
from collections import Counter

import pytest
import reasoning_gym
import torch
from reasoning_gym.utils import extract_answer
from scripted_inference import ScriptedInference

from llmrl.agents import build_agent
from llmrl.config import ConfigError, EnvironmentConfig
from llmrl.envs.reasoning_gym import MISSING_EXTRA, ReasoningGymAgent
from llmrl.rollouts.metrics import rollout_metrics

TASKS = ["basic_arithmetic", "chain_sum", "leg_counting", "spell_backward"]


def completions_for(answer: str) -> list[str]:
    """Right, partly right, wrong, untagged and tagged twice (the last tag counts)."""
    return [
        f"Working it out.\n<answer>{answer}</answer>",
        f"<answer>x{answer}</answer>",
        "<answer>no idea</answer>",
        answer,
        f"<answer>{answer}</answer> or rather <answer>{answer}0</answer>",
    ]


def answering(agent: ReasoningGymAgent, completions=completions_for):
    """A scripted model that answers sample i of a problem with `completions(answer)[i]`."""
    entries = [p.answer for p in agent.train_problems + agent.eval_problems]

    def reply(prompt: str, index: int) -> str:
        (entry,) = [e for e in entries if prompt.endswith(f"{e['question']}\n<assistant>")]
        return completions(entry["answer"])[index]

    return ScriptedInference(reply)


def draw(agent, inference, groups, group_size):
    return asyncio.run(agent.group_rollouts(inference, groups, group_size))


@pytest.mark.parametrize("task", TASKS)
def test_the_reward_is_the_librarys_score_of_the_tagged_answer(task):
    agent = ReasoningGymAgent(dataset=task, size=16, eval_size=4, env_id="rg")
    groups = draw(agent, answering(agent), 4, 5)
    library = reasoning_gym.create_dataset(task)
    problems = {p.id: p for p in agent.train_problems}
    for group in groups:
        entry = problems[group.rollouts[0].problem_id].answer
        expected = [
            library.score_answer(answer=extract_answer(text), entry=entry)
            for text in completions_for(entry["answer"])
        ]
        assert [r.reward for r in group.rollouts] == expected
        assert [r.reward_components for r in group.rollouts] == [{task: score} for score in expected]
        assert expected[0] == 1.0 and expected[2] < 1.0 and expected[3] == 0.0  # untagged: no answer
    assert agent.pop_metrics() == {}


def test_the_marked_format_reads_a_boxed_answer_and_the_completion_format_a_bare_one():
    def boxed(answer):
        return [f"so \\boxed{{{answer}}}"]

    def bare(answer):
        return [f" {answer}\n"]

    rewards = {}
    for answer_format in ("answer_tags", "marked", "completion"):
        for reply in (boxed, bare):
            agent = ReasoningGymAgent(dataset="chain_sum", size=8, eval_size=2, answer_format=answer_format)
            groups = draw(agent, answering(agent, reply), 4, 1)
            rewards[answer_format, reply.__name__] = [r.reward for g in groups for r in g.rollouts]
    # chain_sum gives a reply with the number in it, not alone, partial credit.
    assert all(0 < reward < 1 for reward in rewards.pop(("completion", "boxed")))
    assert rewards == {
        ("answer_tags", "boxed"): [0.0] * 4,
        ("answer_tags", "bare"): [0.0] * 4,
        ("marked", "boxed"): [1.0] * 4,
        ("marked", "bare"): [0.0] * 4,
        ("completion", "bare"): [1.0] * 4,
    }


def test_the_draw_follows_the_seed_and_the_held_out_problems_do_not():
    def ids(agent):
        return [p.id for p in agent.train_problems], [p.id for p in agent.eval_problems]

    first, again = (ReasoningGymAgent(dataset="chain_sum", size=50, eval_size=10, seed=3) for _ in range(2))
    other = ReasoningGymAgent(dataset="chain_sum", size=50, eval_size=10, seed=4)
    assert ids(first) == ids(again)
    assert ids(first)[0] != ids(other)[0]
    assert ids(first)[1] == ids(other)[1]  # the same evaluation whatever the run's seed
    assert [p.prompt for p in first.train_problems] == [p.prompt for p in again.train_problems]


def test_evaluation_problems_are_never_trained_on_in_a_small_problem_space():
    # Sums of two one-digit numbers: 100 distinct questions, so draws repeat and overlap.
    small = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    agent = ReasoningGymAgent(dataset="chain_sum", config=small, size=300, eval_size=30)
    train = [p.answer["question"] for p in agent.train_problems]
    held_out = [p.answer["question"] for p in agent.eval_problems]
    assert len(set(train)) == len(train) and len(set(held_out)) == len(held_out)
    assert not set(train) & set(held_out)
    assert 0 < len(train) < 300 and 0 < len(held_out) <= 30


def test_a_mix_draws_tasks_by_weight_and_logs_each_tasks_reward():
    agent = ReasoningGymAgent(
        datasets={"chain_sum": {"weight": 3}, "leg_counting": {"weight": 1, "config": {"max_animals": 4}}},
        size=400,
        eval_size=40,
        env_id="mix",
    )
    counts = Counter(p.id.split("/")[0] for p in agent.train_problems)
    assert set(counts) == {"chain_sum", "leg_counting"}
    assert 0.65 < counts["chain_sum"] / sum(counts.values()) < 0.85, counts
    groups = draw(agent, answering(agent), 24, 2)
    for rollout in (r for g in groups for r in g.rollouts):
        assert list(rollout.reward_components) == [rollout.problem_id.split("/")[0]]
    metrics = rollout_metrics(groups, torch.zeros(48), correct_threshold=1.0)
    # Sample 0 is right, sample 1 partly right: each task's mean is between.
    assert 0.5 < metrics["reward/mix/chain_sum"] < 1.0
    assert 0.5 < metrics["reward/mix/leg_counting"] < 1.0


def test_a_score_answer_that_raises_is_a_counted_reward_failure():
    # boxnet parses the answer as JSON and fails on a list where it expects objects.
    agent = ReasoningGymAgent(dataset="boxnet", size=4, eval_size=1, env_id="boxes")
    (group,) = draw(agent, ScriptedInference("<answer>[[1,2],[3]]</answer>"), 1, 2)
    assert [r.status for r in group.rollouts] == ["placeholder", "placeholder"]
    reason = group.rollouts[0].failure_reason
    assert reason.startswith("reward: reasoning-gym boxnet.score_answer: AttributeError"), reason
    assert agent.pop_metrics() == {"failures/reward": 2.0, "placeholders": 2.0}


def build(agent_args):
    return build_agent(EnvironmentConfig(agent_type="reasoning_gym", agent_args=agent_args))


@pytest.mark.parametrize(
    ("agent_args", "message"),
    [
        (
            {"dataset": "chain_sun"},
            "dataset: unknown reasoning-gym dataset 'chain_sun'; e.g. chain_sum, decimal_chain_sum (",
        ),
        (
            {"datasets": {"leg_count": {}}},
            "datasets: unknown reasoning-gym dataset 'leg_count'; e.g. leg_counting",
        ),
        (
            {"dataset": "chain_sum", "config": {"terms": 3}},
            "config.terms: not a field of chain_sum's config; valid: ",
        ),
        (
            {"dataset": "chain_sum", "config": {"min_terms": 0}},
            "config (chain_sum): min_terms must be positive",
        ),
        (
            {"datasets": {"basic_arithmetic": {"config": {"operators": "x"}}}},
            "datasets.basic_arithmetic.config (basic_arithmetic): unsupported operator: x",
        ),
        ({"dataset": "chain_sum", "config": {"seed": 1}}, "config.seed: set by the agent"),
        (
            {"datasets": {"chain_sum": {"weight": 0}}},
            "datasets.chain_sum.weight: expected a number > 0, got 0",
        ),
        ({}, "give either dataset (one task) or datasets (a weighted mix)"),
    ],
)
def test_a_mistake_is_one_line_naming_the_field(agent_args, message):
    with pytest.raises(ConfigError) as caught:
        build(agent_args)
    text = str(caught.value)
    assert text.startswith("environment 'reasoning_gym' (reasoning_gym): ") and "\n" not in text
    assert message in text


def test_without_the_extra_the_line_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an environment without it imports
    with pytest.raises(ConfigError) as caught:
        build({"dataset": "chain_sum"})
    assert str(caught.value).endswith(MISSING_EXTRA)
    assert (
        MISSING_EXTRA
        == "agent_type reasoning_gym needs the reasoning-gym extra: pip install 'llmrl[reasoning-gym]'"
    )
