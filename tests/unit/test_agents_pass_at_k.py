"""pass@k: the estimator against exact enumeration, and the evaluation wrapper."""

import asyncio
import itertools
import math

import pytest
from scripted_inference import EchoAgent, ScriptedInference

from llmrl.agents import PassAtKAgent, evaluation_metrics, pass_at_k
from llmrl.types import EvaluationResponse, EvaluationResult


def enumerated_pass_at_k(n, c, k):
    """Fraction of all k-subsets of n samples (the first c correct) that contain a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_estimator_matches_exact_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(enumerated_pass_at_k(n, c, k), abs=1e-12)


def test_estimator_is_stable_for_large_n():
    # C(1000, 500) overflows a float; the running product does not.
    expected = 1 - math.comb(990, 500) / math.comb(1000, 500)
    assert pass_at_k(1000, 10, 500) == pytest.approx(expected, rel=1e-12)
    assert pass_at_k(10_000, 1, 1) == pytest.approx(1e-4)


@pytest.mark.parametrize("n, c, k", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_estimator_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_wrapper_reports_pass_at_k_greedy_accuracy_and_mean_reward():
    # Problem with index i has its first (i % 4) samples right, and is greedy-correct when i is even.
    class ScriptedByTemperature(ScriptedInference):
        def _complete(self, prompt_ids, prompt, sample, request):
            self.greedy = request.generation_args.temperature == 0.0
            return super()._complete(prompt_ids, prompt, sample, request)

    def reply(prompt, sample):
        index = int(prompt.rsplit("say a", 1)[1])
        right = index % 2 == 0 if inference.greedy else sample < index % 4
        return f"a{index}" if right else "wrong"

    inference = ScriptedByTemperature(reply)
    agent = EchoAgent(num_problems=40, eval_size=8)
    wrapper = PassAtKAgent(agent, n=4, ks=[1, 2, 4], greedy=True, correct_threshold=1.0)
    response = asyncio.run(wrapper.evaluate(inference, 8))
    metrics = evaluation_metrics(response)

    counts = [int(p.id[1:]) % 4 for p in agent.eval_problems]
    for k in (1, 2, 4):
        expected = sum(enumerated_pass_at_k(4, c, k) for c in counts) / len(counts)
        assert metrics[f"pass@{k}"] == pytest.approx(expected)
    assert metrics["reward_mean"] == pytest.approx(sum(counts) / 32)
    evens = sum(int(p.id[1:]) % 2 == 0 for p in agent.eval_problems)
    assert metrics["greedy_accuracy"] == pytest.approx(evens / 8)


def test_correct_threshold_decides_what_counts():
    class HalfReward(EchoAgent):
        def reward(self, response, problem):
            return 0.5

    half = HalfReward(num_problems=10, eval_size=2)
    inference = ScriptedInference("x")
    strict = evaluation_metrics(
        asyncio.run(PassAtKAgent(half, n=2, ks=[1], greedy=False).evaluate(inference, 2))
    )
    lenient = asyncio.run(
        PassAtKAgent(half, n=2, ks=[1], greedy=False, correct_threshold=0.5).evaluate(inference, 2)
    )
    assert strict["pass@1"] == 0.0 and evaluation_metrics(lenient)["pass@1"] == 1.0
    assert "greedy_accuracy" not in strict


def test_ks_must_fit_n():
    with pytest.raises(ValueError, match="ks must be"):
        PassAtKAgent(EchoAgent(), n=4, ks=[1, 8])


def test_evaluation_metrics():
    # problem a: 2 of 4 samples correct; problem b: 0 of 4. pass@2 for a = 1 - C(2,2)/C(4,2) = 5/6.
    response = EvaluationResponse(
        env_id="e",
        ks=[1, 2, 8],
        results=[
            EvaluationResult(
                problem_id="a", prompt="x", completions=["1"] * 4, rewards=[1, 0, 1, 0], greedy_reward=1.0
            ),
            EvaluationResult(
                problem_id="b", prompt="y", completions=["1"] * 4, rewards=[0, 0, 0, 0.5], greedy_reward=0
            ),
        ],
    )
    metrics = evaluation_metrics(response)
    assert metrics["reward_mean"] == pytest.approx(2.5 / 8)
    assert metrics["accuracy"] == pytest.approx(2 / 8)
    assert metrics["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert metrics["pass@2"] == pytest.approx((5 / 6 + 0.0) / 2)
    assert "pass@8" not in metrics  # k > n is not estimable
    assert metrics["greedy_accuracy"] == 0.5
