"""The learning signal: advantages and loss (`AlgorithmConfig`, with the allowed values of its options)
and on-policy distillation from a teacher (`DistillationConfig`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llmrl.config.inference import ServeConfig
from llmrl.config.sections import Section

# The allowed values of the algorithm's options, declared once: the fields below and `llmrl.algorithms` use
# them.
AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo"]
StdScope = Literal["group", "batch"]
RatioLevel = Literal["token", "sequence"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
ISMode = Literal["truncate", "mask"]


class AlgorithmConfig(Section):
    advantage_estimator: AdvantageEstimator = "grpo"
    """Baseline of each group: GRPO (mean, std-normalised), Dr. GRPO (mean only) or RLOO."""
    batch_std_normalize: bool = False
    """Divide advantages by the std over the whole batch (REINFORCE++ style)."""
    advantage_std_scope: StdScope = "group"
    """Rewards whose std divides `grpo` advantages: the group's (GRPO), or every valid reward of the step
    (TRL's scale_rewards: batch)."""
    advantage_std_ddof: int = Field(0, ge=0, le=1)
    """Degrees of freedom of every advantage std: 0 the population std (GRPO paper), 1 the sample std
    (TRL)."""
    advantage_eps: float = Field(1e-6, ge=0.0)
    """Added to every advantage std before dividing by it (TRL: 1e-4)."""
    clip_low: float = Field(0.2, ge=0.0)
    """Lower PPO clip range: ratios below 1 - clip_low are clipped."""
    clip_high: float = Field(0.28, ge=0.0)
    """Upper PPO clip range (DAPO clip-higher): ratios above 1 + clip_high are clipped."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None turns it off."""
    ratio_level: RatioLevel = "token"
    """Importance ratio per token (PPO/GRPO) or per sequence, length-normalised (GSPO)."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become one number (see llmrl.algorithms.losses)."""
    max_length: int | None = Field(None, ge=1)
    """Constant divisor for `seq_mean_token_sum_norm` (Dr. GRPO); defaults to generation max_tokens."""
    kl_beta: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty to the reference policy; 0 skips the reference model entirely."""
    kl_estimator: KLEstimator = "k3"
    """Estimator of KL(policy || reference) per token (Schulman's k1/k2/k3)."""
    kl_ratio_weighted: bool = False
    """Multiply each token's KL by the importance ratio, which makes its gradient the unbiased reverse-KL
    gradient (DeepSeek-V3.2; TRL's use_bias_correction_kl)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus."""
    is_mode: Literal["auto", ISMode, "off"] = "auto"
    """Trainer/inference mismatch correction: truncated IS weights, sequence masking, or off; `auto` is
    `truncate` when training.generation_lag > 0, else off."""

    @field_validator("is_mode", mode="before")
    @classmethod
    def _yaml_null_or_off(cls, value: Any) -> Any:
        return "off" if value is None or value is False else value  # YAML reads `off` as false

    is_cap: float = Field(2.0, gt=0.0)
    """Cap of the truncated importance weights (`truncate`) or mismatch threshold (`mask`)."""
    overlong_buffer: int | None = Field(None, ge=1)
    """DAPO soft overlong punishment: length of the penalty ramp before max_tokens; None is off."""
    overlong_penalty: float = Field(1.0, ge=0.0)
    """Largest penalty of the soft overlong punishment (reached at max_tokens)."""
    mask_truncated: bool = False
    """Drop completions that hit max_tokens from the loss."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: replace groups whose rewards are all equal (they carry no signal)."""
    max_resample_rounds: int = Field(3, ge=0)
    """Bound on redraws of zero-signal groups per step."""


class TeacherServerConfig(Section):
    """A distillation teacher behind an inference server (docs/algorithms.md, "A served teacher"): llmrl's
    (`llmrl serve-inference --model TEACHER`) or vLLM's (`vllm serve TEACHER --max-logprobs K`), asked for
    its `prompt_logprobs` of each sampled sequence. Name one server: `url` (one you run) or `serve` (one
    llmrl starts for the run)."""

    url: str | None = None
    """The server's API root, e.g. http://127.0.0.1:8100/v1 (`/v1` may be left out)."""
    serve: ServeConfig | None = None
    """A server that llmrl starts for the run instead (`ServeConfig`), logging to `RUN_DIR/teacher_server/`:
    under torchrun one, which rank 0 starts and alone asks; vLLM's with `--max-logprobs distillation.top_k`."""
    model: str | None = None
    """The model name sent with each request; None: the first the server lists (`/v1/models`)."""
    api_key_env: str | None = None
    """Name of the environment variable that holds the server's bearer token, if it needs one."""
    max_concurrent: int = Field(16, ge=1)
    """Most requests in flight (one per sequence scored)."""
    request_timeout_s: float = Field(120.0, gt=0)
    """Longest one request may take; a request that fails (no answer, a timeout, 5xx) is retried."""
    max_retries: int = Field(3, ge=0)
    """Further attempts at a failed request, 0.5 s, 1 s, 2 s, ... apart; after the last, the run stops
    (exit status 75: rerunning resumes)."""

    @model_validator(mode="after")
    def _one_server(self) -> TeacherServerConfig:
        if (self.url is None) == (self.serve is None):
            raise ValueError(
                "name one teacher server: `url` (a server you run) or `serve` (one llmrl starts for the run)"
            )
        return self


class DistillationConfig(Section):
    """On-policy distillation (docs/algorithms.md): a teacher scores every position the policy samples,
    and the policy is trained to lower its per-token reverse KL to the teacher there. The teacher must
    share the policy's tokenizer. Name one teacher: `teacher` (loaded in the trainer's process) or
    `teacher_server` (served)."""

    teacher: str | None = None
    """The teacher, loaded in the trainer's process: anything `model.spec` takes (`tiny://NAME`, a local
    folder, a hub id), or a run or checkpoint folder of an earlier llmrl run (its latest checkpoint's model;
    a LoRA run's adapter merged onto its base)."""
    teacher_server: TeacherServerConfig | None = None
    """The teacher behind an inference server instead (`TeacherServerConfig`): it takes no memory of the
    trainer's."""
    signal: Literal["top_k", "sampled"] = "top_k"
    """`top_k`: at each completion position, the exact reverse KL from the policy's next-token
    distribution to the teacher's over the teacher's `top_k` likeliest tokens and the rest of the
    vocabulary as one more outcome, a loss term weighted by `coef` (no sampling noise); `sampled`: the
    one-sample estimate, each token's advantage gaining `coef * (teacher logprob - policy logprob)` of
    the sampled token. `top_k` compares whole distributions, so it refuses rollouts sampled with
    top-k/top-p/min-p filters."""
    top_k: int = Field(64, ge=1)
    """Teacher tokens kept per position with `signal: top_k` (the rest count as one outcome)."""
    coef: float = Field(1.0, gt=0.0)
    """Weight of the distillation term (the KL loss term, or the per-token advantage)."""
    teacher_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype the teacher is loaded and run in; None: `model.dtype` (a served teacher runs in its server's)."""
    rewards: Literal["add", "ignore"] = "add"
    """`add`: the environments' group advantages train the policy too, beside the distillation term (an
    environment without rewards gives equal rewards, hence zero group advantages, and distillation
    alone); `ignore`: the teacher alone trains the policy."""

    @model_validator(mode="after")
    def _one_teacher(self) -> DistillationConfig:
        if (self.teacher is None) == (self.teacher_server is None):
            raise ValueError(
                "name one teacher: `teacher` (a model loaded in the trainer's process) or `teacher_server` "
                "(one behind an inference server)"
            )
        if self.teacher_server is not None and self.teacher_dtype is not None:
            raise ValueError("teacher_dtype: a served teacher runs in its server's dtype; leave it unset")
        return self
