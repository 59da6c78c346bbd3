"""Evaluation never scores a failure as a wrong answer, counts its failures apart from the training
steps' (and says them on its line), and asks for more samples than a server's `n` cap in parts."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest
from scripted_inference import EchoAgent, ScriptedInference, answer_of

from llmrl.agents import PassAtKAgent, WeightedMultiTask, evaluation_metrics
from llmrl.config import EvaluationConfig
from llmrl.envs.arithmetic import ArithmeticAgent
from llmrl.evaluation import evaluate_environments
from llmrl.inference.engine import LocalEngine
from llmrl.inference.openai import OpenAIInterface
from llmrl.server.inference_server import create_inference_app
from llmrl.trainer.evaluator import Evaluator
from llmrl.types import GenerationArgs, InferenceRequest


class CountingTransport(httpx.ASGITransport):
    def __init__(self, app):
        super().__init__(app)
        self.bodies: list[bytes] = []

    async def handle_async_request(self, request):
        if request.url.path.endswith("completions"):
            self.bodies.append(request.content)
        return await super().handle_async_request(request)


def test_more_samples_than_the_servers_cap_are_asked_for_in_parts(tiny_model):
    """The reported case: samples_per_prompt 65 against a server capping n at 64 scored every sample 0."""
    model, tokenizer = tiny_model
    transport = CountingTransport(
        create_inference_app(LocalEngine(copy.deepcopy(model), tokenizer), model_name="tiny")
    )
    inference = OpenAIInterface("http://server", transport=transport)
    agent = PassAtKAgent(ArithmeticAgent(env_id="arith", seed=0, eval_size=2), n=65, ks=[1, 64], greedy=False)
    response = asyncio.run(agent.evaluate(inference, 1, generation_args=GenerationArgs(max_tokens=3, seed=5)))
    (result,) = response.results
    assert result.failed == 0 and len(result.rewards) == len(result.completions) == 65
    assert len(transport.bodies) == 2  # 64 + 1
    assert {"pass@1", "pass@64"} <= set(evaluation_metrics(response)) and evaluation_metrics(response)[
        "failed_samples"
    ] == 0.0

    async def sample_twice():  # parts are seeded from the request's seed: the same request, the same tokens
        request = InferenceRequest(
            prompt="1 + 2 =", n=66, generation_args=GenerationArgs(max_tokens=3, seed=9)
        )
        return [await inference.agenerate(request) for _ in range(2)]

    first, second = asyncio.run(sample_twice())
    assert [r.token_ids for r in first] == [r.token_ids for r in second] and len(first) == 66


class FlakyInference(ScriptedInference):
    """Fails every request whose prompt asks for an answer in `broken`."""

    def __init__(self, broken):
        super().__init__(lambda prompt, index: answer_of(prompt))
        self.broken = broken

    async def agenerate(self, request):
        if any(f"say {answer}" in str(request.prompt) for answer in self.broken):
            raise ConnectionError("inference server went away")
        return await super().agenerate(request)


def test_failed_samples_are_counted_not_scored_as_wrong():
    agents = WeightedMultiTask([EchoAgent(env_id="echo", seed=0, eval_size=4)], [1.0])
    problems = agents.agents[0].eval_problems
    config = EvaluationConfig(num_prompts=4, samples_per_prompt=2, ks=[1, 2], greedy=True)
    summary = asyncio.run(
        evaluate_environments(agents, FlakyInference({problems[0].answer}), config, GenerationArgs())
    )
    metrics = summary["echo"]
    assert metrics["failed_samples"] == 3.0  # problem 0: 2 samples and its greedy one
    assert (
        metrics["pass@1"] == metrics["accuracy"] == metrics["greedy_accuracy"] == 1.0
    )  # the others, all right
    everything = FlakyInference({p.answer for p in problems})
    metrics = asyncio.run(evaluate_environments(agents, everything, config, GenerationArgs()))["echo"]
    assert metrics == {"problems": 4.0, "failed_samples": 12.0}  # no accuracy at all rather than a false 0


class BrokenReward(EchoAgent):
    def reward(self, response, problem):
        raise KeyError("answer")


def test_an_evaluations_failures_are_counted_by_it_not_by_the_training_step_after_it():
    """Step 1's failure counters held the starting evaluation's failures as well as its own."""
    agents = WeightedMultiTask([BrokenReward(env_id="echo", seed=0, eval_size=4)], [1.0])
    inference = ScriptedInference(lambda prompt, index: answer_of(prompt))
    config = EvaluationConfig(num_prompts=4, samples_per_prompt=2, ks=[1, 2], greedy=True)

    async def evaluate_while_a_batch_generates():
        return await asyncio.gather(
            evaluate_environments(agents, inference, config, GenerationArgs()),
            agents.group_rollouts(inference, 2, 3),
        )

    summary, groups = asyncio.run(evaluate_while_a_batch_generates())
    assert summary["echo"] == {"problems": 4.0, "failed_samples": 12.0}
    assert sum(not r.is_valid for g in groups for r in g.rollouts) == 6
    assert agents.pop_metrics() == {"echo/failures/reward": 6.0, "echo/placeholders": 6.0}


def test_the_evaluation_line_says_how_many_samples_failed():
    evaluator = Evaluator(None, EvaluationConfig(), GenerationArgs(seed=0))
    evaluator.evaluations = {
        0: {"echo": {"pass@1": 0.5, "greedy_accuracy": 1.0, "failed_samples": 3.0}},
        2: {"echo": {"pass@1": 0.75, "greedy_accuracy": 1.0, "failed_samples": 0.0}},
    }
    assert evaluator.line(0) == (
        "evaluation before training (step 0): echo: pass@1 0.500, greedy_accuracy 1.000, 3 failed samples"
    )
    assert evaluator.line(2) == "evaluation at step 2: echo: pass@1 0.750, greedy_accuracy 1.000"


@pytest.mark.parametrize("n, parts", [(64, [64]), (65, [64, 1]), (130, [64, 64, 2])])
def test_split_sizes(n, parts):
    from llmrl.inference.openai import _split

    split = _split(InferenceRequest(prompt="p", n=n, generation_args=GenerationArgs(seed=1)), 64)
    assert [r.n for r in split] == parts and split[0].generation_args.seed == 1
    assert len({r.generation_args.seed for r in split}) == len(parts)
