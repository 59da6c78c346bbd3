"""WeightedMultiTask: the allocation table, isolation of broken agents, dynamic sampling, building from
config."""

import asyncio
import warnings

import pytest
from scripted_inference import EchoAgent, ScriptedInference, answer_of

from llmrl import registry
from llmrl.agents import WeightedMultiTask, build_agents, evaluation_metrics, largest_remainder
from llmrl.config import EnvironmentConfig


def run(coroutine):
    return asyncio.run(coroutine)


def agents(*names, **kwargs):
    return [EchoAgent(env_id=name, eval_size=4, **kwargs) for name in names]


@pytest.mark.parametrize(
    "weights, num_groups, expected, warns",
    [
        ([1, 2], 8, [3, 5], True),
        ([3, 1], 8, [6, 2], False),
        ([1, 1], 8, [4, 4], False),
        ([1, 0], 8, [8, 0], False),
        ([100, 1], 4, [3, 1], True),  # the minimum of one group wins over the weights
        ([100, 1, 1], 3, [1, 1, 1], True),
        ([0.5, 0.25, 0.25], 10, [5, 3, 2], True),  # equal remainders go to the first
    ],
)
def test_allocation_table(weights, num_groups, expected, warns):
    multi = WeightedMultiTask(agents(*"abc"[: len(weights)]), weights)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert multi.allocation(num_groups) == expected
    assert bool(caught) == warns
    if warns:
        assert "cannot be met exactly" in str(caught[0].message)


def test_more_environments_than_groups_is_an_error():
    with pytest.raises(
        ValueError, match="3 environments have a positive weight but a step has only 2 groups"
    ):
        WeightedMultiTask(agents("a", "b", "c"), [1, 1, 1]).allocation(2)


def test_largest_remainder_always_sums_to_the_total():
    for num_groups in range(3, 30):
        for weights in ([1, 2, 3], [0.01, 5, 0.2], [7, 0, 1]):
            counts = largest_remainder(weights, num_groups)
            assert sum(counts) == num_groups
            assert all((c >= 1) == (w > 0) for c, w in zip(counts, weights, strict=True))


def test_evaluation_only_agents_are_evaluated_but_never_trained_on():
    multi = WeightedMultiTask(agents("train", "held"), [1, 5], evaluation_only=[False, True])
    assert multi.allocation(4) == [4, 0]
    inference = ScriptedInference(lambda prompt, i: answer_of(prompt))
    groups = run(multi.group_rollouts(inference, 4, 2))
    assert {r.env_id for g in groups for r in g.rollouts} == {"train"}
    results = run(multi.evaluate(inference, 2, samples_per_prompt=2, ks=[1, 2]))
    assert set(results) == {"train", "held"}
    assert evaluation_metrics(results["held"])["pass@2"] == 1.0


def test_groups_come_from_each_agent_in_order_and_concurrently():
    multi = WeightedMultiTask(agents("a", "b"), [1, 3])
    inference = ScriptedInference("x")
    groups = run(multi.group_rollouts(inference, 4, 3))
    assert [g.rollouts[0].env_id for g in groups] == ["a", "b", "b", "b"]
    assert inference.max_in_flight == 4


def test_a_broken_agent_gives_placeholder_groups_and_the_batch_goes_on():
    class Broken(EchoAgent):
        async def group_rollouts(self, *args, **kwargs):
            raise RuntimeError("env server down")

        async def evaluate(self, *args, **kwargs):
            raise RuntimeError("env server down")

    multi = WeightedMultiTask([*agents("good"), Broken(env_id="bad", eval_size=4)], [1, 1])
    inference = ScriptedInference("x")
    groups = run(multi.group_rollouts(inference, 4, 2))
    bad = [g for g in groups if g.rollouts[0].env_id == "bad"]
    assert len(groups) == 4 and len(bad) == 2
    assert all(
        r.status == "placeholder" and "env server down" in r.failure_reason for g in bad for r in g.rollouts
    )
    assert len({g.group_id for g in groups}) == 4
    metrics = multi.pop_metrics()
    assert metrics["bad/placeholders"] == 4 and metrics["bad/failures/group_rollouts"] == 1
    results = run(multi.evaluate(inference, 2))
    assert results["bad"].results == [] and results["good"].results


def test_dynamic_sampling_replaces_zero_signal_groups_within_the_bound():
    # Problems p0..p9: even ones get mixed rewards (signal), odd ones all-equal rewards (no signal).
    def reply(prompt, i):
        index = int(prompt.rsplit("say a", 1)[1])
        return f"a{index}" if index % 2 == 0 and i == 0 else "wrong"

    inference = ScriptedInference(reply)
    multi = WeightedMultiTask(
        [EchoAgent(num_problems=10, env_id="e", eval_size=0)],
        [1],
        dynamic_sampling=True,
        max_resample_rounds=20,
    )
    groups = run(multi.group_rollouts(inference, 3, 2))
    assert len(groups) == 3
    assert all(sorted(g.rewards) == [0.0, 1.0] for g in groups)
    metrics = multi.pop_metrics()
    assert (
        metrics["e/dynamic_sampling/dropped_groups"] >= 1
        and metrics["e/dynamic_sampling/zero_signal_kept"] == 0
    )

    bounded = WeightedMultiTask(
        [EchoAgent(num_problems=10, env_id="e", eval_size=0)],
        [1],
        dynamic_sampling=True,
        max_resample_rounds=0,
    )
    groups = run(bounded.group_rollouts(ScriptedInference("wrong"), 3, 2))
    assert len(groups) == 3  # nothing has signal: after 0 rounds the dropped groups fill the batch
    assert bounded.pop_metrics()["e/dynamic_sampling/zero_signal_kept"] == 3


def test_state_dict_round_trip_and_missing_env():
    multi = WeightedMultiTask(agents("a", "b"), [1, 1])
    run(multi.group_rollouts(ScriptedInference("x"), 4, 1))
    state = multi.state_dict()
    fresh = WeightedMultiTask(agents("a", "b"), [1, 1])
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    with pytest.raises(ValueError, match=r"no entry for environments \['b'\]"):
        fresh.load_state_dict({"a": state["a"]})


@pytest.fixture
def echo_registered(monkeypatch):
    monkeypatch.setattr(registry, "_agents", dict(registry._agents))
    registry.register_agent("echo", EchoAgent)


def test_build_agents_from_config(echo_registered):
    environments = [
        EnvironmentConfig(agent_type="echo", agent_args={"num_problems": 12, "eval_size": 2}, weight=2),
        EnvironmentConfig(
            agent_type="echo", env_id="echo_eval", agent_args={"eval_size": 3}, evaluation_only=True
        ),
    ]
    multi = build_agents(environments, seed=4, dynamic_sampling=True)
    first, second = multi.agents
    assert (first.env_id, first.seed, first.num_problems, first.eval_size) == ("echo", 4, 12, 2)
    assert second.env_id == "echo_eval" and multi.evaluation_only == [False, True]
    assert multi.weights == [2.0, 0.0] and multi.dynamic_sampling


@pytest.mark.parametrize(
    "agent_args, message",
    [
        (
            {"num_problem": 3},
            r"environment 'echo': unknown agent_args \['num_problem'\] for 'echo'; valid: .*num_problems",
        ),
        ({"env_id": "x"}, r"environment 'echo': agent_args must not set \['env_id'\]"),
        ({"max_turns": 0}, r"environment 'echo' \(echo\): max_turns must be >= 1"),
        (
            {"generation_args": {"max_tokens": -1}},
            r"environment 'echo' \(echo\): generation_args.max_tokens: Input should be greater than or equal to 1",
        ),
    ],
)
def test_bad_agent_args_name_the_environment_and_argument(echo_registered, agent_args, message):
    with pytest.raises(ValueError, match=message):
        build_agents([EnvironmentConfig(agent_type="echo", agent_args=agent_args)])
