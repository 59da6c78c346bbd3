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
        self.policy_version: int | None = None  # of the first sampled token, the oldest
        self.version_changes: list[tuple[int, int]] = []  # where newer weights took over, as in TokenRollout
        self.last: InferenceResponse | None = None

    def add_context(self, ids: list[int], text: str) -> None:
        """Append tokens the model did not sample (a prompt, a user or tool turn): masked out."""
        self._add(ids, False, None, text)

    def add_completion(self, response: InferenceResponse) -> None:
        """Append a completion as sampled: its ids, trained on, with their logprobs and versions."""
        start = len(self.tokens)
        changes = [(start, response.policy_version)] + [(start + i, v) for i, v in response.version_changes]
        if self.policy_version is None:
            self.policy_version = response.policy_version
            changes = changes[1:]
        newest = self.version_changes[-1][1] if self.version_changes else self.policy_version
        for at, version in changes:
            if version < newest:
                raise ValueError(
                    f"the inference interface answered with weight version {version} after version {newest}"
                )
            if version > newest:
                self.version_changes.append((at, version))
                newest = version
        self._add(response.token_ids, True, response.logprobs, response.text)
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
            version_changes=self.version_changes,
            # The last model turn read every earlier token: its routes are the whole trajectory's.
            routed_experts=self.last.routed_experts,
        )
