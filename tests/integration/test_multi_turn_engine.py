"""Multi-turn episodes through the real engine: the trajectory is exactly what the model saw and sampled."""

import asyncio

import pytest
import torch

from llmrl.envs.arithmetic import ArithmeticAgent
from llmrl.inference.engine import LocalEngine
from llmrl.rewards.arithmetic import score
from llmrl.types import GenerationArgs

pytestmark = pytest.mark.slow


class RetryArithmetic(ArithmeticAgent):
    """A wrong answer gets 'Try again.' back, up to max_turns model turns."""

    def observe(self, turn, response, problem):
        return None if score(response.text, problem.answer) == 1.0 else "Try again."


def test_multi_turn_trajectory_matches_a_teacher_forced_pass(tiny_model):
    model, tokenizer = tiny_model
    engine = LocalEngine(model, tokenizer, seed=0)
    agent = RetryArithmetic(env_id="retry", max_turns=3, eval_size=4, seed=0)
    groups = asyncio.run(agent.group_rollouts(engine, 4, 4, GenerationArgs(max_tokens=8, seed=5)))
    rollouts = [r for g in groups for r in g.rollouts]
    assert all(r.status == "ok" for r in rollouts)
    assert any(len(r.trajectory) > 2 for r in rollouts), "some episode should need a second turn"
    for rollout in rollouts:
        # segments alternate: prompt, model, user, model, ...; only model segments are masked in
        assert [all(m) for m in rollout.generation_mask] == [
            i % 2 == 1 for i in range(len(rollout.trajectory))
        ]
        tokens = torch.tensor([rollout.tokens])
        with torch.no_grad():
            logits = model(tokens).logits.float()
        forced = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, tokens[0, 1:, None])[:, 0]
        mask = torch.tensor(rollout.mask[1:])
        engine_logprobs = torch.tensor(rollout.flat_logprobs[1:])
        assert torch.allclose(engine_logprobs[mask], forced[mask], atol=1e-4)
