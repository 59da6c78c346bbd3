"""One token trajectory being built: context segments (masked out of the loss) and sampled completions.

Multi-turn reward-only episodes (`llmrl.agents.reward_only`) and agent programs' sequences
(`llmrl.agents.endpoint`) grow their rollouts with it, from the exact ids the inference interface
returned: nothing is re-tokenised.
"""

from __future__ import annotations

from llmrl.types import GenerationArgs, InferenceResponse, TokenRollout


class Trajectory:
    """Token segments of one sequence: prompt, model turn, what came between, model turn, ..."""

    def __init__(self, args: GenerationArgs):
        self.args = args
        self.segments: list[list[int]] = []
        self.masks: list[list[bool]] = []
        self.logprobs: list[list[float]] | None = []
        self.texts: list[str] = []
        self.tokens: list[int] = []
        self.policy_version: int | None = None
        self.last: InferenceResponse | None = None

    def add_context(self, ids: list[int], text: str) -> None:
        """Append tokens the model did not sample (a prompt, a user or tool turn): masked out."""
        self._add(ids, False, None, text)

    def add_completion(self, response: InferenceResponse) -> None:
        """Append a completion as sampled: its ids, trained on, with their logprobs."""
        self._add(response.token_ids, True, response.logprobs, response.text)
        versions = [v for v in (self.policy_version, response.policy_version) if v is not None]
        self.policy_version = min(versions)
        self.last = response

    def _add(self, ids: list[int], generated: bool, logprobs: list[float] | None, text: str) -> None:
        self.segments.append(list(ids))
        self.masks.append([generated] * len(ids))
        self.texts.append(text)
        self.tokens.extend(ids)
        if self.logprobs is not None and (logprobs is not None or not generated):
            self.logprobs.append(list(logprobs) if generated else [0.0] * len(ids))
        else:  # an engine that returns no logprobs for one turn leaves the trajectory without them
            self.logprobs = None

    def rollout(
        self, env_id: str, problem_id: str, reward: float, components: dict[str, float] | None = None
    ) -> TokenRollout:
        assert self.last is not None, "a trajectory without a completion has nothing to train on"
        return TokenRollout(
            trajectory=self.segments,
            generation_mask=self.masks,
            logprobs=self.logprobs,
            generation_args=self.args,
            text=self.texts,
            reward=reward,
            reward_components=components or {},
            env_id=env_id,
            problem_id=problem_id,
            truncated=self.last.finish_reason == "length",
            policy_version=self.policy_version or 0,
        )
