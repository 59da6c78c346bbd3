"""pass@k evaluation: the unbiased estimator, the metrics of an evaluation, and an agent wrapper that
sets the n and ks they are computed with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmrl.agents.base import Agent, PromptRoom
from llmrl.inference.interface import InferenceInterface
from llmrl.types import EvaluationResponse, GenerationArgs, RolloutGroup


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n is correct.

    The unbiased estimator of Chen et al., "Evaluating Large Language Models Trained on Code" (2021):
    pass@k = 1 - C(n-c, k) / C(n, k). The ratio of binomials is evaluated as a running product,
    prod_{i=n-c+1}^{n} (1 - k/i), which never forms the (huge) binomial coefficients and so stays
    exact to float precision for any n.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    failure = 1.0
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def evaluation_metrics(response: EvaluationResponse) -> dict[str, float]:
    """Mean reward, sampled accuracy, unbiased pass@k, greedy accuracy and the failed samples.

    Failed samples are not scored: the rest are, and a problem left with fewer than k scored
    samples has no pass@k. `failed_samples` says how many there were (0 when none).
    """
    metrics: dict[str, float] = {}
    if not response.results:
        return metrics
    threshold = response.correct_threshold
    metrics["failed_samples"] = float(sum(result.failed for result in response.results))
    all_rewards = [r for result in response.results for r in result.rewards]
    if all_rewards:
        metrics["reward_mean"] = sum(all_rewards) / len(all_rewards)
        metrics["accuracy"] = sum(r >= threshold for r in all_rewards) / len(all_rewards)
    for k in response.ks:
        per_problem = []
        for result in response.results:
            n = len(result.rewards)
            if k <= n:
                correct = sum(r >= threshold for r in result.rewards)
                per_problem.append(pass_at_k(n, correct, k))
        if per_problem:
            metrics[f"pass@{k}"] = sum(per_problem) / len(per_problem)
    greedy = [result.greedy_reward for result in response.results if result.greedy_reward is not None]
    if greedy:
        metrics["greedy_accuracy"] = sum(r >= threshold for r in greedy) / len(greedy)
    return metrics


class PassAtKAgent(Agent):
    """Evaluates a wrapped agent with n samples per problem: pass@k for each k, greedy accuracy, mean reward.

    Training calls go straight to the wrapped agent. A sample counts as correct when its reward is
    at least `correct_threshold`; `evaluation_metrics` computes the metrics.
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

    def check_problems(self) -> None:
        self.agent.check_problems()

    def drop_overlong_prompts(self, room: PromptRoom, generation_args: GenerationArgs) -> None:
        self.agent.drop_overlong_prompts(room, generation_args)

    def state_dict(self) -> dict[str, Any]:
        return self.agent.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.agent.load_state_dict(state)

    def pop_metrics(self) -> dict[str, float]:
        return self.agent.pop_metrics()
