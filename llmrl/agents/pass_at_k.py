"""pass@k evaluation: an agent wrapper that reports it.

The unbiased estimator `pass_at_k` (Chen et al., 2021) lives beside the wire type whose `metrics()`
use it, `llmrl.types.EvaluationResponse`, and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmrl.agents.base import Agent
from llmrl.inference.interface import InferenceInterface
from llmrl.types import EvaluationResponse, GenerationArgs, RolloutGroup, pass_at_k

__all__ = ["PassAtKAgent", "pass_at_k"]


class PassAtKAgent(Agent):
    """Evaluates a wrapped agent with n samples per problem: pass@k for each k, greedy accuracy, mean reward.

    Training calls go straight to the wrapped agent. A sample counts as correct when its reward is
    at least `correct_threshold`; the metrics come from `EvaluationResponse.metrics()`.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        n: int = 8,
        ks: Sequence[int] = (1,),
        greedy: bool = True,
        correct_threshold: float = 1.0,
        generation_args: GenerationArgs | None = None,
    ):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        bad = [k for k in ks if not 1 <= k <= n]
        if bad or not ks:
            raise ValueError(f"ks must be a non-empty list of values in 1..n (n={n}), got {list(ks)}")
        self.agent = agent
        self.env_id = agent.env_id
        self.n = n
        self.ks = sorted(set(ks))
        self.greedy = greedy
        self.correct_threshold = correct_threshold
        self.generation_args = generation_args

    async def group_rollouts(
        self,
        inference: InferenceInterface,
        num_groups: int,
        group_size: int,
        generation_args: GenerationArgs | None = None,
    ) -> list[RolloutGroup]:
        return await self.agent.group_rollouts(inference, num_groups, group_size, generation_args)

    async def evaluate(
        self,
        inference: InferenceInterface,
        num_prompts: int,
        *,
        samples_per_prompt: int | None = None,
        greedy: bool | None = None,
        generation_args: GenerationArgs | None = None,
    ) -> EvaluationResponse:
        """Evaluate with this wrapper's settings; the keyword arguments, when given, override them."""
        n = samples_per_prompt or self.n
        if max(self.ks) > n:
            raise ValueError(f"samples_per_prompt={n} is smaller than the largest k ({max(self.ks)})")
        response = await self.agent.evaluate(
            inference,
            num_prompts,
            samples_per_prompt=n,
            greedy=self.greedy if greedy is None else greedy,
            generation_args=generation_args or self.generation_args,
        )
        return EvaluationResponse(
            env_id=response.env_id,
            results=response.results,
            ks=self.ks,
            correct_threshold=self.correct_threshold,
        )

    def state_dict(self) -> dict[str, Any]:
        return self.agent.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.agent.load_state_dict(state)

    def pop_metrics(self) -> dict[str, float]:
        return self.agent.pop_metrics()
