"""Wire types: the only objects that cross process boundaries (agents <-> inference <-> trainer).

This is the one module for every HTTP boundary's bodies too (the environment server's requests and
responses, the inference server's OpenAI-compatible bodies), so that a client and its server import
them from the bottom layer rather than from each other.

Every type is a pydantic v2 model that forbids unknown fields, so a typo in a request or a
config is an error naming the field instead of a silently ignored value. All of them round-trip
through JSON (`model_dump_json` / `model_validate_json`).

Logprob semantics (shared by every inference interface and the trainer): ``logprobs[i]`` is the
log-probability of completion token i under the distribution it was actually sampled from, in
float32: ``log_softmax(logits_i / temperature)[token_i]`` with the default options, renormalised
over the tokens min-p, top-k and top-p keep when those are on, and taken of the penalised logits
with repetition/presence penalties or `min_tokens`. The options travel with each rollout
(`TokenRollout.generation_args`) and the trainer recomputes its logprobs with them; those it cannot
reproduce (the penalties and `min_tokens`) are refused for training.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from llmrl.versions import MAX_POLICY_VERSION, check_version_changes, expand_versions

MIN_TEMPERATURE = 1e-5
"""Smallest temperature above 0: below it ``logits / T`` overflows float32 (NaN probabilities); 0 is
greedy."""

FinishReason = Literal["stop", "length", "abort"]
RolloutStatus = Literal["ok", "placeholder", "failed"]


def validation_problems(errors: Iterable[Mapping[str, Any]], prefix: str = "") -> str:
    """pydantic's `errors()` as one line: ``{prefix}{loc.path}: {message}`` for each, joined by ``; ``."""
    return "; ".join(
        f"{prefix}{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in errors
    )


class WireModel(BaseModel):
    """Base of all wire types: unknown fields are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GenerationArgs(WireModel):
    """Sampling parameters of one request. Immutable: derive variants with `merge` or `model_copy`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(
        1.0,
        ge=0.0,
        allow_inf_nan=False,
        description=f"Softmax temperature; 0 means greedy decoding, otherwise at least {MIN_TEMPERATURE}.",
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass in (0, 1]; 1 keeps all."
    )
    top_k: StrictInt = Field(0, ge=0, description="Keep the k most likely tokens; 0 turns top-k off.")
    min_p: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="Keep tokens at least min_p times as likely as the most likely one; 0 turns it off.",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Divide the positive logits (multiply the negative ones) of tokens "
        "already in the prompt or completion by this; 1 turns it off. Not for training.",
    )
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted from the logits of tokens already in the completion; 0 turns it "
        "off. Not for training.",
    )
    min_tokens: StrictInt = Field(
        0,
        ge=0,
        description="Completion tokens before eos and stop_token_ids may be sampled. Not for training.",
    )
    ignore_eos: bool = Field(False, description="Go on after eos (it no longer ends the completion).")
    max_tokens: StrictInt = Field(256, ge=1, description="Maximum number of completion tokens.")
    stop: tuple[str, ...] = Field((), description="Strings that end the completion (not included in it).")
    stop_token_ids: tuple[StrictInt, ...] = Field(
        (), description="Token ids that end the completion (included)."
    )
    seed: StrictInt | None = Field(None, description="Sampling seed; the same seed gives the same tokens.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables of the chat template, e.g. {enable_thinking: false} for Qwen3."
    )

    @field_validator("temperature")
    @classmethod
    def _temperature_samples(cls, temperature: float) -> float:
        if 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {temperature}"
            )
        return temperature

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, stop: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_not_negative(cls, ids: tuple[int, ...]) -> tuple[int, ...]:
        if any(i < 0 for i in ids):
            raise ValueError("stop token ids must be >= 0")
        return ids

    @property
    def filters(self) -> list[str]:
        """The filters of the sampled distribution set here: "top_k", "top_p", "min_p" (none: the whole
        distribution at `temperature`)."""
        used = {"top_k": bool(self.top_k), "top_p": self.top_p < 1.0, "min_p": bool(self.min_p)}
        return [name for name, on in used.items() if on]

    @property
    def untrainable_options(self) -> dict[str, Any]:
        """Options set here that the trainer cannot reproduce (history-dependent penalties, `min_tokens`)."""
        neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "min_tokens": 0}
        return {name: getattr(self, name) for name, value in neutral.items() if getattr(self, name) != value}

    def merge(self, other: GenerationArgs | dict[str, Any] | None) -> GenerationArgs:
        """Return a copy with the fields *explicitly set* in `other` laid over this one."""
        if other is None:
            return self
        if isinstance(other, dict):
            other = GenerationArgs.model_validate(other)
        overrides = {name: getattr(other, name) for name in other.model_fields_set}
        return self.model_copy(update=overrides)


class ChatMessage(WireModel):
    """One message of a chat prompt."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class InferenceRequest(WireModel):
    """A prompt (plain text or chat messages) and how to sample `n` completions of it."""

    prompt: str | list[ChatMessage]
    generation_args: GenerationArgs = Field(default_factory=GenerationArgs)
    n: StrictInt = Field(1, ge=1, description="Number of completions to sample for this prompt.")
    prompt_token_ids: list[StrictInt] | None = Field(
        None,
        description=(
            "Token ids that come before `prompt`, used verbatim (multi-turn continuation: the previous "
            "prompt and completion ids). The engine appends the tokens of `prompt` to them: a string "
            "tokenised without special tokens, chat messages rendered as a follow-up turn ending in the "
            "generation prompt. The response's `prompt_token_ids` is the whole prompt, these ids first."
        ),
    )

    @field_validator("prompt")
    @classmethod
    def _messages_not_empty(cls, prompt: str | list[ChatMessage]) -> str | list[ChatMessage]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must contain at least one chat message")
        return prompt

    @model_validator(mode="after")
    def _text_not_empty(self) -> InferenceRequest:
        # An empty string after `prompt_token_ids` asks for a completion of exactly those ids (a
        # prompt rendered by the caller: the endpoint of `llmrl.agents.endpoint`).
        if self.prompt == "" and self.prompt_token_ids is None:
            raise ValueError("prompt must be a non-empty string (or empty after prompt_token_ids)")
        return self

    @field_validator("prompt_token_ids")
    @classmethod
    def _prefix_ids_valid(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and (not ids or any(i < 0 for i in ids)):
            raise ValueError("prompt_token_ids must be a non-empty list of ids >= 0 (or null)")
        return ids


class RoutedExperts(WireModel):
    """The experts a mixture-of-experts model's routers chose, per token it read, per MoE layer, the top
    k in the router's order (router replay, `llmrl.models.routing`): ``[tokens, layers, k]`` 16-bit
    little-endian integers, base64; -1 where a token has no recorded route."""

    shape: tuple[StrictInt, StrictInt, StrictInt]
    data: str

    @model_validator(mode="after")
    def _size_matches_shape(self) -> RoutedExperts:
        tokens, layers, k = self.shape
        if min(self.shape) < 0 or layers == 0 or k == 0:
            raise ValueError(f"shape must be [tokens >= 0, layers >= 1, k >= 1], got {list(self.shape)}")
        if len(self.data) != 4 * math.ceil(2 * tokens * layers * k / 3):
            raise ValueError(
                f"data holds {len(self.data)} base64 characters, not {tokens}x{layers}x{k} int16"
            )
        return self


class InferenceResponse(WireModel):
    """One sampled completion, with the exact tokens and logprobs the engine produced."""

    text: str
    prompt_token_ids: list[int]
    token_ids: list[int] = Field(description="Completion token ids only.")
    logprobs: list[float] | None = Field(None, description="One logprob per completion token.")
    finish_reason: FinishReason
    policy_version: int = Field(
        0,
        ge=0,
        le=MAX_POLICY_VERSION,
        description="Version of the weights that generated it (its first token, with in-flight updates).",
    )
    version_changes: list[tuple[StrictInt, StrictInt]] = Field(
        default_factory=list,
        description=(
            "Where new weights took over mid-completion (in-flight weight updates): pairs [i, v], completion "
            "token i and those after it sampled by version v, until the next pair. Empty: every token by "
            "`policy_version`."
        ),
    )
    routed_experts: RoutedExperts | None = Field(
        None,
        description=(
            "With router replay: the experts chosen for every token the engine read, the prompt's and each "
            "completion token's but the last (which no forward read)."
        ),
    )

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> InferenceResponse:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries but token_ids has {len(self.token_ids)}; "
                "there must be one logprob per completion token"
            )
        check_version_changes(self.version_changes, self.policy_version, len(self.token_ids))
        return self

    def token_versions(self) -> list[int]:
        """The weight version of each completion token."""
        return expand_versions(self.version_changes, self.policy_version, len(self.token_ids))


class TokenRollout(WireModel):
    """A token trajectory split into segments (prompt, model turn, user turn, model turn, ...).

    `generation_mask[s][i]` is True exactly for tokens the model sampled; `logprobs[s][i]` is the
    inference engine's logprob for those tokens and 0.0 elsewhere. The token ids are the exact ids
    the engine produced: earlier turns are never re-tokenised.
    """

    reward: float = 0.0
    reward_components: dict[str, float] = Field(
        default_factory=dict,
        description="Named parts of the reward (reward functions' values), logged per environment.",
    )
    env_id: str = Field(min_length=1)
    problem_id: str = Field(min_length=1)
    status: RolloutStatus = "ok"
    failure_reason: str | None = None
    truncated: bool = Field(False, description="True when the last generation hit max_tokens.")
    policy_version: int = Field(
        0, ge=0, description="Oldest weight version used in the trajectory (that of its first sampled token)."
    )
    version_changes: list[tuple[StrictInt, StrictInt]] = Field(
        default_factory=list,
        description=(
            "Where newer weights took over (a later turn, or in-flight updates within one): pairs [i, v] "
            "over the flattened trajectory, its sampled tokens from position i on by version v, until the "
            "next pair. Empty: every sampled token by `policy_version`."
        ),
    )
    routed_experts: RoutedExperts | None = Field(
        None,
        description=(
            "With router replay: the experts the engine chose for the flattened trajectory's tokens (of its "
            "last model turn, which read all earlier ones); positions past them route live."
        ),
    )
    kind: Literal["token"] = "token"
    """The trajectory's form; token ids are the only one (saved rollout banks carry the field)."""
    trajectory: list[list[int]]
    generation_mask: list[list[bool]]
    logprobs: list[list[float]] | None = None
    generation_args: GenerationArgs | None = Field(
        None,
        description="How the model turns were sampled: the trainer takes its logprobs of the same distribution.",
    )
    text: list[str] | None = Field(None, description="Decoded segments, for logs and debugging.")
    extra_sequences: list[TokenRollout] = Field(
        default_factory=list,
        description=(
            "Further token sequences of the same episode (an agent program's calls that did not extend "
            "this one): trained with this rollout's advantage, each on its own."
        ),
    )

    @field_validator("reward")
    @classmethod
    def _reward_finite(cls, reward: float) -> float:
        if not math.isfinite(reward):
            raise ValueError(f"reward must be a finite number, got {reward}")
        return reward

    @field_validator("reward_components")
    @classmethod
    def _components_finite(cls, components: dict[str, float]) -> dict[str, float]:
        bad = {name: value for name, value in components.items() if not math.isfinite(value)}
        if bad:
            raise ValueError(f"reward components must be finite numbers, got {bad}")
        return components

    @property
    def is_valid(self) -> bool:
        """True for rollouts that take part in group statistics and the loss."""
        return self.status == "ok"

    @model_validator(mode="after")
    def _segments_line_up(self) -> TokenRollout:
        lengths = [len(s) for s in self.trajectory]
        if [len(m) for m in self.generation_mask] != lengths:
            raise ValueError("generation_mask must have the same segment lengths as trajectory")
        if self.logprobs is not None and [len(lp) for lp in self.logprobs] != lengths:
            raise ValueError("logprobs must have the same segment lengths as trajectory")
        check_version_changes(self.version_changes, self.policy_version, sum(lengths))
        return self

    @property
    def newest_version(self) -> int:
        """Newest weight version used in the trajectory."""
        return self.version_changes[-1][1] if self.version_changes else self.policy_version

    @property
    def token_versions(self) -> list[int]:
        """The weight version at each position of `tokens` (meaningful where `mask` is True)."""
        return expand_versions(self.version_changes, self.policy_version, sum(map(len, self.trajectory)))

    @property
    def tokens(self) -> list[int]:
        return [t for segment in self.trajectory for t in segment]

    @property
    def mask(self) -> list[bool]:
        return [m for segment in self.generation_mask for m in segment]

    @property
    def flat_logprobs(self) -> list[float] | None:
        if self.logprobs is None:
            return None
        return [lp for segment in self.logprobs for lp in segment]

    @property
    def num_generated(self) -> int:
        return sum(self.mask)

    @property
    def sequences(self) -> list[TokenRollout]:
        """The episode's token sequences: this one, then `extra_sequences`."""
        return [self, *self.extra_sequences]


class RolloutGroup(WireModel):
    """The rollouts of one prompt (a GRPO group)."""

    group_id: str = Field(min_length=1)
    rollouts: list[TokenRollout] = Field(min_length=1)

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]


class EvaluationResult(WireModel):
    """Samples and rewards of one evaluation problem."""

    problem_id: str
    prompt: str | list[ChatMessage]
    completions: list[str]
    rewards: list[float]
    """The scored samples; failed ones are counted in `failed`, not scored as wrong."""
    greedy_completion: str | None = None
    greedy_reward: float | None = None
    failed: int = Field(0, ge=0, description="Samples (greedy included) whose inference or reward failed.")

    @model_validator(mode="after")
    def _one_reward_per_completion(self) -> EvaluationResult:
        if len(self.completions) != len(self.rewards):
            raise ValueError("completions and rewards must have the same length")
        return self


class EvaluationResponse(WireModel):
    """All evaluation results of one environment, and the settings its metrics are derived with
    (`llmrl.agents.pass_at_k.evaluation_metrics`)."""

    env_id: str
    results: list[EvaluationResult]
    correct_threshold: float = Field(1.0, description="A sample counts as correct when reward >= this.")
    ks: list[int] = Field(default_factory=lambda: [1], description="k values to report pass@k for.")


# ---------------------------------------------------------------------------------------------
# The environment server (llmrl.server.env_server) and its client (llmrl.agents.remote)


def check_http_url(url: str) -> str:
    """`url` if it is an http(s) URL with a host and no credentials in it, else ValueError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL with a host, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("must not contain credentials (pass tokens by environment variable)")
    return url


class InferenceEndpoint(BaseModel):
    """The OpenAI-compatible server the environments call back to sample completions."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # frozen: hashable, a cache key

    base_url: str = Field(max_length=2048, description="e.g. http://10.0.0.5:8000/v1 (http or https).")
    model: str | None = Field(None, max_length=512, description="Model name sent in each request, if any.")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return check_http_url(url)


class GroupRolloutsRequest(WireModel):
    """`num_groups` training problems, `group_size` scored samples each."""

    num_groups: StrictInt = Field(ge=1, le=1024)
    group_size: StrictInt = Field(ge=1, le=256)
    generation_args: GenerationArgs | None = None
    inference: InferenceEndpoint
    env_id: str | None = Field(
        None, max_length=256, description="One environment; null mixes the training environments by weight."
    )


class GroupRolloutsResponse(WireModel):
    groups: list[RolloutGroup]
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description="The environments' failure counters since the last call, keyed env_id/name.",
    )


class EvaluateRequest(WireModel):
    """Held-out evaluation with pass@k, as `WeightedMultiTask.evaluate` does it."""

    num_prompts: StrictInt = Field(ge=1, le=10_000)
    samples_per_prompt: StrictInt = Field(1, ge=1, le=256)
    ks: list[StrictInt] = Field(default_factory=lambda: [1], min_length=1, max_length=256)
    greedy: bool = False
    correct_threshold: float = Field(1.0, allow_inf_nan=False)
    generation_args: GenerationArgs | None = None
    inference: InferenceEndpoint
    env_id: str | None = Field(None, max_length=256, description="One environment; null evaluates all.")

    @model_validator(mode="after")
    def _ks_fit_the_samples(self) -> EvaluateRequest:
        bad = [k for k in self.ks if not 1 <= k <= self.samples_per_prompt]
        if bad:
            raise ValueError(f"ks must be in 1..samples_per_prompt ({self.samples_per_prompt}), got {bad}")
        return self


class EvaluateResponse(WireModel):
    results: dict[str, list[EvaluationResult]]
    """env_id -> its per-problem results. The pass@k settings are the request's, so they are not sent
    back: the caller computes its metrics with its own (`llmrl.agents.pass_at_k.evaluation_metrics`)."""


class EnvironmentInfo(WireModel):
    env_id: str
    agent_type: str
    weight: float
    evaluation_only: bool
    num_train_problems: int | None = None
    num_eval_problems: int | None = None


class ServerInfo(WireModel):
    environments: list[EnvironmentInfo]
    endpoints: list[str]


class AgentStates(WireModel):
    """Problem-order state of environments: env id -> that agent's `state_dict()`."""

    state: dict[str, dict[str, Any]]


# ---------------------------------------------------------------------------------------------
# The inference server (llmrl.server.inference_server): OpenAI-compatible bodies and weight updates

DEFAULT_MAX_TOKENS = 16
"""Completion length when a request sets no ``max_tokens`` (OpenAI's default for completions)."""


class GenerationFields(BaseModel):
    """Fields shared by both generation routes. Unknown fields are kept: the server refuses those it does not
    implement."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Echoed in the response; this server serves one model.")
    n: StrictInt = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt = Field(0, ge=-1, description="Extension; 0 or -1 (vLLM's spelling) turn top-k off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    min_tokens: StrictInt = Field(0, ge=0)
    ignore_eos: StrictBool = False
    max_tokens: StrictInt | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    logprobs: StrictBool | StrictInt | None = Field(
        None, description="True or an int (completions' top count) adds OpenAI logprobs."
    )
    stop_token_ids: list[StrictInt] | None = None
    prompt_token_ids: list[StrictInt] | None = None

    def completion_limit(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS


class CompletionBody(GenerationFields):
    prompt: str | list[StrictInt] = Field(
        description="A text, or token ids (OpenAI's and vLLM's form) completed as they are."
    )
    prompt_logprobs: StrictInt | None = Field(
        None,
        ge=0,
        description=(
            "vLLM's extension: each choice also carries, for each prompt token after the first, its logprob "
            "and rank and the `prompt_logprobs` likeliest tokens there (a distillation teacher's scores)."
        ),
    )


class MessagePart(BaseModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON text (OpenAI's form).")


class ToolCall(BaseModel):
    """A tool call of an assistant message, as OpenAI clients send it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class OpenAIMessage(BaseModel):
    """A chat message as OpenAI clients send it (text content, or a list of text parts; `name` ignored).

    The llmrl server renders role and text only; agent programs' endpoint (`llmrl.agents.endpoint`)
    also renders an assistant's `tool_calls` and a tool message's `tool_call_id`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[MessagePart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def to_chat_message(self) -> ChatMessage:
        return ChatMessage(role=self.role, content=self.text)


class ChatBody(GenerationFields):
    messages: list[OpenAIMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables of the chat template."
    )
    max_completion_tokens: StrictInt | None = Field(
        None, ge=1, description="OpenAI's newer name for max_tokens."
    )

    def completion_limit(self) -> int:
        return self.max_completion_tokens or super().completion_limit()


class WeightsByPath(BaseModel):
    """JSON body of ``POST /v1/weights``: load `path` (inside the server's weights folder) as `version`."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0, le=MAX_POLICY_VERSION, strict=True)
    path: str = Field(min_length=1)
    reset: bool = False
    """Serve these weights even if `version` is not newer (a trainer starting or resuming a run)."""
