"""Mixing environments by weight, and building them from the run config.

Each step's `num_groups` prompt groups are split over the training environments by the largest
remainder method (Hamilton apportionment): every environment first gets the integer part of its
exact share ``num_groups * w_i / sum(w)``, every positive weight at least one group, and the groups
left over go to the largest fractional parts. When the shares are not whole numbers the split
cannot follow the weights exactly, and a warning says so.

Optional DAPO dynamic sampling (Yu et al., "DAPO", 2025, section 3.2): groups whose valid rewards
are all equal give zero GRPO advantage, so they are dropped and replacement groups drawn from the
same environment, at most `max_resample_rounds` times; if groups are still missing after that, the
dropped ones fill the batch so that its size stays `num_groups`.

A broken environment never takes the run down: an agent whose `group_rollouts` raises contributes
placeholder groups, and one whose `evaluate` raises reports no results.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

from llmrl.agents.base import Agent, PromptRoom, has_signal, placeholder_rollout, placeholders_logged_once
from llmrl.agents.pass_at_k import PassAtKAgent
from llmrl.config import ConfigError, EnvironmentConfig
from llmrl.inference.interface import InferenceInterface
from llmrl.registry import get_agent_class
from llmrl.types import EvaluationResponse, GenerationArgs, RolloutGroup

log = logging.getLogger(__name__)


def largest_remainder(weights: Sequence[float], num_groups: int) -> list[int]:
    """Split `num_groups` by `weights`; every positive weight gets at least one group, zero weights none."""
    positive = [i for i, w in enumerate(weights) if w > 0]
    if any(w < 0 or not math.isfinite(w) for w in weights) or not positive:
        raise ValueError(f"weights must be finite, >= 0, and at least one > 0, got {list(weights)}")
    if len(positive) > num_groups:
        raise ValueError(
            f"{len(positive)} environments have a positive weight but a step has only {num_groups} groups; "
            "raise training.prompts_per_step or set some weights to 0"
        )
    total = sum(weights)
    quotas = [num_groups * w / total for w in weights]
    counts = [max(math.floor(q), 1) if w > 0 else 0 for q, w in zip(quotas, weights, strict=True)]
    # The minimum of one can overshoot; take back from whoever is furthest above its quota.
    while sum(counts) > num_groups:
        i = max((i for i in positive if counts[i] > 1), key=lambda i: counts[i] - quotas[i])
        counts[i] -= 1
    by_remainder = sorted(positive, key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: num_groups - sum(counts)]:
        counts[i] += 1
    return counts


class WeightedMultiTask:
    """Several agents behind one `group_rollouts`, mixed by weight; evaluation covers all of them."""

    def __init__(
        self,
        agents: Sequence[Agent],
        weights: Sequence[float],
        evaluation_only: Sequence[bool] | None = None,
        *,
        dynamic_sampling: bool = False,
        max_resample_rounds: int = 3,
    ):
        evaluation_only = list(evaluation_only) if evaluation_only is not None else [False] * len(agents)
        if not len(agents) == len(weights) == len(evaluation_only):
            raise ValueError("agents, weights and evaluation_only must have the same length")
        ids = [a.env_id for a in agents]
        if len(set(ids)) != len(ids):
            raise ValueError(f"env ids must be unique, got {ids}")
        if max_resample_rounds < 0:
            raise ValueError(f"max_resample_rounds must be >= 0, got {max_resample_rounds}")
        self.agents = list(agents)
        self.weights = [0.0 if only else float(w) for w, only in zip(weights, evaluation_only, strict=True)]
        self.evaluation_only = evaluation_only
        self.dynamic_sampling = dynamic_sampling
        self.max_resample_rounds = max_resample_rounds
        self._counters: Counter[str] = Counter()
        self._failed_draws = 0
        if any(w < 0 or not math.isfinite(w) for w in self.weights) or not any(w > 0 for w in self.weights):
            raise ValueError(
                f"weights must be finite and >= 0, and one training environment needs weight > 0; got {self.weights}"
            )

    def allocation(self, num_groups: int) -> list[int]:
        """Groups per agent for one step (0 for evaluation-only agents); warns when weights can't be met."""
        counts = largest_remainder(self.weights, num_groups)
        total = sum(self.weights)
        exact = [num_groups * w / total for w in self.weights]
        if any(abs(c - q) > 1e-9 for c, q in zip(counts, exact, strict=True)):
            ideal = ", ".join(f"{a.env_id}={q:.2f}" for a, q in zip(self.agents, exact, strict=True))
            warnings.warn(
                f"weights {self.weights} cannot be met exactly with {num_groups} groups per step "
                f"(ideal: {ideal}); using {counts}",
                stacklevel=2,
            )
        return counts

    async def group_rollouts(
        self,
        inference: InferenceInterface,
        num_groups: int,
        group_size: int,
        generation_args: GenerationArgs | None = None,
    ) -> list[RolloutGroup]:
        """`num_groups` groups from all training agents, drawn concurrently, in agent order; each distinct
        failure is logged once, with its count over the step's draws (dynamic sampling's included)."""
        counts = self.allocation(num_groups)
        draws = [
            self._draw(agent, count, inference, group_size, generation_args)
            for agent, count in zip(self.agents, counts, strict=True)
            if count > 0
        ]
        with placeholders_logged_once("this step"):
            drawn = await asyncio.gather(*draws)
        return [group for groups in drawn for group in groups]

    def slots(self, num_groups: int) -> list[int]:
        """The agent index of each of a step's `num_groups` groups (`allocation`, in agent order): drawing
        one group at a time, group k comes from ``slots[k % num_groups]``, so every `num_groups`
        consecutive groups follow the weights as a step's batch does."""
        return [i for i, count in enumerate(self.allocation(num_groups)) for _ in range(count)]

    async def one_group(
        self,
        agent_index: int,
        inference: InferenceInterface,
        group_size: int,
        generation_args: GenerationArgs | None = None,
    ) -> RolloutGroup:
        """One group from the agent at `agent_index` (a placeholder group when its agent raises).

        Built-in agents draw the problem before their first `await`, so the agents' state right after
        this coroutine first yields includes it (partial rollouts rely on that to regenerate a group)."""
        agent = self.agents[agent_index]
        (group,) = await self._safe_group_rollouts(agent, 1, inference, group_size, generation_args)
        return group

    async def _draw(
        self,
        agent: Agent,
        count: int,
        inference: InferenceInterface,
        group_size: int,
        generation_args: GenerationArgs | None,
    ) -> list[RolloutGroup]:
        groups = await self._safe_group_rollouts(agent, count, inference, group_size, generation_args)
        if not self.dynamic_sampling:
            return groups
        kept = [g for g in groups if has_signal(g)]
        dropped = [g for g in groups if not has_signal(g)]
        rounds = 0
        while len(kept) < count and rounds < self.max_resample_rounds:
            rounds += 1
            more = await self._safe_group_rollouts(
                agent, count - len(kept), inference, group_size, generation_args
            )
            kept += [g for g in more if has_signal(g)]
            dropped += [g for g in more if not has_signal(g)]
        self._counters[f"{agent.env_id}/dynamic_sampling/dropped_groups"] += len(dropped)
        self._counters[f"{agent.env_id}/dynamic_sampling/rounds"] += rounds
        filler = dropped[: count - len(kept)]
        self._counters[f"{agent.env_id}/dynamic_sampling/zero_signal_kept"] += len(filler)
        return kept + filler

    async def _safe_group_rollouts(
        self,
        agent: Agent,
        count: int,
        inference: InferenceInterface,
        group_size: int,
        generation_args: GenerationArgs | None,
    ) -> list[RolloutGroup]:
        try:
            groups = await agent.group_rollouts(inference, count, group_size, generation_args)
            if len(groups) != count:
                raise RuntimeError(f"asked for {count} groups, got {len(groups)}")
            return groups
        except Exception as exc:
            reason = f"group_rollouts: {type(exc).__name__}: {exc}"[:500]
            log.warning("%s: %s (%d group(s) replaced by placeholders)", agent.env_id, reason, count)
            self._counters[f"{agent.env_id}/failures/group_rollouts"] += 1
            self._counters[f"{agent.env_id}/placeholders"] += count * group_size
            self._failed_draws += 1
            return [
                RolloutGroup(
                    group_id=f"{agent.env_id}/failed-{self._failed_draws}-{i}",
                    rollouts=[
                        placeholder_rollout(agent.env_id, "unavailable", reason) for _ in range(group_size)
                    ],
                )
                for i in range(count)
            ]

    async def evaluate(
        self,
        inference: InferenceInterface,
        num_prompts: int,
        *,
        samples_per_prompt: int = 1,
        ks: Sequence[int] = (1,),
        greedy: bool = False,
        correct_threshold: float = 1.0,
        generation_args: GenerationArgs | None = None,
    ) -> dict[str, EvaluationResponse]:
        """Every agent (training and evaluation-only) on its held-out problems, concurrently."""
        wrapped = [
            PassAtKAgent(
                agent, n=samples_per_prompt, ks=ks, greedy=greedy, correct_threshold=correct_threshold
            )
            for agent in self.agents
        ]

        async def evaluate_one(agent: PassAtKAgent) -> EvaluationResponse:
            try:
                return await agent.evaluate(inference, num_prompts, generation_args=generation_args)
            except Exception as exc:
                log.warning("%s: evaluation failed: %s: %s", agent.env_id, type(exc).__name__, exc)
                self._counters[f"{agent.env_id}/failures/evaluate"] += 1
                return EvaluationResponse(env_id=agent.env_id, results=[], ks=agent.ks)

        responses = await asyncio.gather(*(evaluate_one(a) for a in wrapped))
        return {response.env_id: response for response in responses}

    def check_problems(self) -> None:
        """Every agent's `check_problems` (datasets load, columns exist, splits are non-empty)."""
        for agent in self.agents:
            agent.check_problems()

    def drop_overlong_prompts(self, room: PromptRoom, generation_args: GenerationArgs) -> None:
        """Every agent's `drop_overlong_prompts`."""
        for agent in self.agents:
            agent.drop_overlong_prompts(room, generation_args)

    def state_dict(self) -> dict[str, Any]:
        return {agent.env_id: agent.state_dict() for agent in self.agents}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [a.env_id for a in self.agents if a.env_id not in state]
        if missing:
            raise ValueError(f"saved agent state has no entry for environments {missing}")
        for agent in self.agents:
            agent.load_state_dict(state[agent.env_id])

    def pop_metrics(self) -> dict[str, float]:
        """Failure and dynamic-sampling counters since the last call, keyed ``env_id/name``."""
        metrics = {
            f"{agent.env_id}/{key}": value
            for agent in self.agents
            for key, value in agent.pop_metrics().items()
        }
        metrics.update({key: float(count) for key, count in self._counters.items()})
        self._counters.clear()
        return metrics


def _accepted_arguments(cls: type) -> set[str] | None:
    """Keyword arguments `cls(...)` accepts, following ``**kwargs`` up the MRO; None if unbounded."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        if klass is object:
            return names
        parameters = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {
            "self"
        }
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            return names
    return None


def build_agent(environment: EnvironmentConfig, seed: int = 0, model_spec: str | None = None) -> Agent:
    """One agent from its config entry: ``cls(**agent_args, seed=seed, env_id=name)``, and
    ``model_spec`` (the run's model) for agents that take it and whose agent_args do not set it."""
    name = environment.name
    cls = get_agent_class(environment.agent_type)
    accepted = _accepted_arguments(cls)
    reserved = {"seed", "env_id"} & set(environment.agent_args)
    if reserved:
        raise ConfigError(
            f"environment {name!r}: agent_args must not set {sorted(reserved)} "
            "(env_id is the environment's own field; the seed comes from the run)"
        )
    if accepted is not None:
        unknown = sorted(set(environment.agent_args) - accepted)
        if unknown:
            valid = ", ".join(sorted(accepted - {"seed", "env_id"}))
            raise ConfigError(
                f"environment {name!r}: unknown agent_args {unknown} for {environment.agent_type!r}; valid: {valid}"
            )
    given = {"seed": seed, "env_id": name}
    extra = {k: v for k, v in given.items() if accepted is None or k in accepted}
    if model_spec is not None and accepted and "model_spec" in accepted - set(environment.agent_args):
        extra["model_spec"] = model_spec
    try:
        return cls(**environment.agent_args, **extra)
    except (ValueError, TypeError) as exc:  # the agent's verdict on its arguments, which come from the config
        raise ConfigError(f"environment {name!r} ({environment.agent_type}): {exc}") from exc


def build_agents(
    environments: Sequence[EnvironmentConfig],
    seed: int = 0,
    *,
    dynamic_sampling: bool = False,
    max_resample_rounds: int = 3,
    model_spec: str | None = None,
) -> WeightedMultiTask:
    """All configured environments as one `WeightedMultiTask` (`model_spec`: the run's model)."""
    return WeightedMultiTask(
        [build_agent(env, seed, model_spec) for env in environments],
        [env.weight for env in environments],
        [env.evaluation_only for env in environments],
        dynamic_sampling=dynamic_sampling,
        max_resample_rounds=max_resample_rounds,
    )
