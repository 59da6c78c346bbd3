"""Agents: where prompts come from and how completions are scored (see docs/agents.md)."""

from llmrl.agents.base import Agent, Problem, PromptRoom, has_signal, make_prompt, placeholder_rollout
from llmrl.agents.multi_task import WeightedMultiTask, build_agent, build_agents, largest_remainder
from llmrl.agents.pass_at_k import PassAtKAgent, evaluation_metrics, pass_at_k
from llmrl.agents.reward_only import ProblemSetAgent, RewardOnlyAgent
from llmrl.agents.sampler import EpochSampler

__all__ = [
    "Agent",
    "EpochSampler",
    "PassAtKAgent",
    "Problem",
    "PromptRoom",
    "ProblemSetAgent",
    "RewardOnlyAgent",
    "WeightedMultiTask",
    "build_agent",
    "build_agents",
    "evaluation_metrics",
    "has_signal",
    "largest_remainder",
    "make_prompt",
    "pass_at_k",
    "placeholder_rollout",
]
