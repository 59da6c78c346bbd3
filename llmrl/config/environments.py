"""What a run learns from and is measured on: the environments (`EnvironmentConfig`) and held-out
evaluation (`EvaluationConfig`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_serializer
from pydantic_core import to_jsonable_python

from llmrl.config.sections import Section, describe_python_object


class EnvironmentConfig(Section):
    agent_type: str | type
    """Registry name of the agent (see `llmrl.registry.agent_names()`); from Python, the agent class itself."""
    agent_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the agent's constructor (from Python they may be objects: reward functions,
    an agent program, a `datasets.Dataset`)."""
    env_id: str | None = None
    """Name used in metrics and logs; defaults to `agent_type`."""
    weight: float = Field(1.0, ge=0.0)
    """Share of each step's prompt groups drawn from this environment."""
    evaluation_only: bool = False
    """Evaluate on this environment but never train on it."""

    @property
    def name(self) -> str:
        if self.env_id:
            return self.env_id
        return self.agent_type if isinstance(self.agent_type, str) else self.agent_type.__name__

    @field_serializer("agent_type", "agent_args", when_used="json")
    @staticmethod
    def _python_objects_described(value: Any) -> Any:
        """A saved config (and a resume's comparison) names the objects a Python caller passed."""
        return to_jsonable_python(value, fallback=describe_python_object)


class EvaluationConfig(Section):
    every: int = Field(10, ge=0)
    """Evaluate every N steps (0 = only at start and end)."""
    at_start: bool = True
    """Evaluate before the first step."""
    at_end: bool = True
    """Evaluate after the last step."""
    num_prompts: int = Field(64, ge=1)
    """Held-out problems per environment."""
    samples_per_prompt: int = Field(8, ge=1)
    """Completions sampled per problem (the n of pass@k)."""
    ks: list[int] = Field(default_factory=lambda: [1, 8])
    """k values for pass@k (each <= samples_per_prompt)."""
    greedy: bool = True
    """Also decode each problem greedily and report greedy accuracy."""
    correct_threshold: float = 1.0
    """A sample counts as correct when its reward is at least this."""
