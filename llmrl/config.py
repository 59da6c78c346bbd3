"""Run configuration: typed, validated at load time, one docstring per field.

A run is described by one YAML file that maps onto `RunConfig`. Any field can be overridden from
the command line with ``--set section.field=value`` (the value is parsed as YAML, so ``3``,
``1e-5``, ``true`` and ``[1, 2]`` mean what they look like); list items are numbered from 0,
``--set environments.0.agent_args.digits=3`` or ``--set environments[0].agent_args.digits=3``.
Unknown keys and values of the wrong type are `ConfigError`s that name the dotted path of the field
and the file it came from, e.g.::

    training.lr: expected a number, got 'fast' (in examples/arithmetic.yaml)

Relative paths of the files a run reads (`plugins`, `model.spec`,
`inference.vllm.python`, an environment's `data_files`, `eval_data_files`, `path` and
`chat_template`) resolve against the config file's folder when the file exists there, otherwise
against the working directory; `load_config` writes the ones found beside the config as paths from
the working directory. The folders a run writes, `run_dir` and `inference.weights_dir`, are always
relative to the working directory.

From Python (`llmrl.train`), a config may hold the objects themselves where a file names code or
data: a reward function, an agent program (`rollout`), an agent class (`agent_type`), a
`datasets.Dataset` (`dataset`, `eval_dataset`). A saved config writes each as its description
(`describe_python_object`), which is also what a resumed run is compared by.

The defaults are general starting points; the built-in demo (`DEMO_CONFIG`, llmrl/demo.yaml), what
``llmrl train`` runs when given no config file, holds the settings vetted on the built-in arithmetic
task with the tiny model.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import to_jsonable_python

from llmrl.errors import UserError
from llmrl.types import GenerationArgs

log = logging.getLogger(__name__)


class ConfigError(UserError):
    """A config file or override is invalid; the message names every bad field."""


PYTHON_OBJECT_PREFIXES = ("<python object: ", "<datasets.")
"""How the descriptions `describe_python_object` writes begin."""


def describe_python_object(value: Any) -> str:
    """How a saved config writes an object a config built in Python holds in place of a name: a
    `datasets.Dataset` by its size and fingerprint (a hash of its content), anything else by its
    ``module:qualname`` (an instance's: its class's). Two runs whose objects have the same
    descriptions count as the same config when one resumes the other."""
    if hasattr(value, "_fingerprint") and hasattr(value, "num_rows"):
        return f"<datasets.{type(value).__name__}: {value.num_rows:,} rows, fingerprint {value._fingerprint}>"
    named = value if hasattr(value, "__qualname__") else type(value)
    instance = "" if named is value else " instance"
    return f"<python object: {named.__module__}:{named.__qualname__}{instance}>"


def is_python_object_description(value: Any) -> bool:
    """Whether `value` is what `describe_python_object` writes (a saved config read back as a config)."""
    return isinstance(value, str) and value.startswith(PYTHON_OBJECT_PREFIXES) and value.endswith(">")


class Section(BaseModel):
    """Base of all config sections: unknown keys are errors; field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class LoraConfig(Section):
    """Low-rank adapters (LoRA, built with `peft`, in its meanings) trained over the frozen base model
    (docs/training.md, LoRA). The adapters are float32 and alone reach the optimizer; the base stays in
    `model.dtype` (`training.master_dtype` does not apply); weight syncs move the adapters only."""

    rank: int = Field(16, ge=1)
    """Rank r of each adapter: A is (r, in_features), B (out_features, r)."""
    alpha: float = Field(32.0, gt=0)
    """Scale numerator: an adapter adds (alpha / rank) * B @ A to its weight."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on an adapter's input while training (0: the trainer's logprobs are those inference samples)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Modules that get adapters: names or name suffixes (`[q_proj, v_proj]`), or `all-linear` (every linear
    layer but the output head)."""

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("name at least one module, or all-linear")
        return value


class ModelConfig(Section):
    spec: str = "tiny://arithmetic"
    """`tiny://arithmetic` (the built-in model), a local folder, or a Hugging Face hub id."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype: the forward and backward passes run in it (autocast in one process, FSDP2's mixed
    precision over several), the embedded engine and vLLM serve in it, and checkpoints' Hugging Face folders
    are written in it. The policy's own weights and optimizer state are kept in `training.master_dtype`.
    float32 gives bitwise-reproducible runs on CPU."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel passed to transformers."""
    trust_remote_code: bool = False
    """Allow model code from the hub; off unless you trust the repository."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (`LoraConfig`); None (absent): full fine-tuning."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's --max-lora-rank takes (a server serves adapters of any rank up to its own)."""


class VLLMConfig(Section):
    """vLLM servers for `inference.type: vllm` (docs/serving.md). With `inference.base_url` unset,
    llmrl starts and stops the servers itself (managed); with it set, it trains from servers a user
    runs (external), after checking that each can be trained from."""

    mode: Literal["servers", "colocate"] = "servers"
    """`servers`: vLLM runs as servers of its own, which llmrl starts (managed) or you run (external, at
    `inference.base_url`), on GPUs of their own; `colocate`: vLLM's engine runs inside the trainer's process
    on the trainer's device (under torchrun, one in every process, all serving rank 0), and each sync hands it
    the trainer's tensors in memory (docs/serving.md says when to use which). Colocated, the trainer needs
    vllm: `llmrl train` runs itself with the interpreter that `python` finds when its own lacks vllm."""
    sleep_level: Literal[0, 1, 2] = 0
    """Colocated on CUDA: the engine sleeps while the trainer updates and wakes for the sync (vLLM's sleep mode,
    CUDA only). 1 discards its KV cache and moves its weights to CPU memory, 2 discards both (the sync sends
    every weight anyway); 0 stays awake. Needs `training.generation_lag: 0` (a lag generates during updates)."""
    num_servers: int = Field(1, ge=1)
    """Managed servers to start; rollouts spread over them (least outstanding requests first)."""
    python: str | None = None
    """Python interpreter with vLLM installed, for managed servers. Default: $LLMRL_VLLM_PYTHON, else the
    `.venv-vllm` that `bash scripts/setup.sh vllm` makes beside llmrl's checkout, else this interpreter if it
    can import vllm."""
    transport: Literal["http", "disk", "nccl"] = "http"
    """How weights reach the servers: `http` (safetensors bytes in the update requests; no GPU needed), `disk`
    (safetensors files in `inference.weights_dir`, read by the servers) or `nccl` (NCCL broadcast from the
    trainer to the servers' GPU workers; needs vllm importable by the trainer too)."""
    host: str = "127.0.0.1"
    """Interface managed servers bind to."""
    port: int = Field(0, ge=0, le=65535)
    """First port of the managed servers (one per server, counting up); 0 picks free ports."""
    max_model_len: int | None = Field(None, ge=16)
    """Longest prompt plus completion the servers accept (vLLM's --max-model-len); None: the model's own
    limit."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per managed server (vLLM's --tensor-parallel-size)."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Share of each GPU a managed server may take (ignored by vLLM's CPU build). Colocated, the engine's share
    of the trainer's GPU: set it to what the trainer leaves (the start-of-run memory plan counts it)."""
    cpu_kv_cache_gib: int = Field(1, ge=1)
    """KV-cache memory in GiB of a managed server or the colocated engine on vLLM's CPU build
    (VLLM_CPU_KVCACHE_SPACE, whole GiB)."""
    extra_args: list[str] = Field(default_factory=list)
    """More command-line arguments for managed servers, passed through as they are."""
    env: dict[str, str] = Field(default_factory=dict)
    """More environment variables for managed servers."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """Longest a managed server may take to answer /health after it starts."""
    control_timeout_s: float = Field(120.0, gt=0)
    """Limit of each control call of a weight sync (pause, start, finish, cache reset, resume); the transfer
    of a bucket has `inference.weight_sync_timeout_s`."""
    max_restarts: int = Field(3, ge=0)
    """Times a managed server that died or failed a weight sync is restarted (and given the last good weights)
    before the run stops."""
    max_loras: int | None = Field(None, ge=1)
    """With `model.lora`: adapter versions a server runs in one batch (vLLM's --max-loras; each sync loads a
    new version beside those requests still use). None: training.generation_lag + 2, resolved when the run
    builds its inference: the versions the lag lets requests run on (lag + 1), and the one being loaded."""

    def resolved_max_loras(self, generation_lag: int) -> int:
        """`max_loras`, or when it is unset the adapter versions a run generating `generation_lag` steps
        ahead needs at once: those requests may still run on (lag + 1), and the one being loaded."""
        return self.max_loras if self.max_loras is not None else generation_lag + 2


DEFAULT_ENGINE_TOKENS = 8192
"""KV-cache tokens of the embedded engine when `inference.max_batch_tokens` is unset, on CPU."""
DEFAULT_CONCURRENT = 64
"""Rows or requests in flight when `inference.max_concurrent` is unset (but for the embedded engine on CUDA)."""


class InferenceConfig(Section):
    type: str = "local"
    """Inference interface from the registry: `local` (embedded engine), `openai` (an OpenAI-compatible HTTP
    server) or `vllm` (managed or external vLLM servers)."""
    base_url: str | list[str] | None = None
    """Base URL of an OpenAI-compatible server (type `openai`), e.g. http://127.0.0.1:8000/v1; for type
    `vllm`, one URL or a list of servers you run (none: llmrl starts its own)."""
    api_key_env: str | None = None
    """Name of the environment variable that holds the server's bearer token, if it needs one."""
    max_batch_tokens: int | None = Field(None, ge=1)
    """Admission budget of the embedded engine: KV-cache tokens of all running sequences (a shared prompt
    counts once). None: 8192 on CPU; on CUDA, what the memory plan leaves of `memory_utilization` x the
    GPU's memory (printed with the plan at the start of the run)."""
    max_concurrent: int | None = Field(None, ge=1)
    """Most sequences decoded at once by the embedded engine or in flight to a server. More rows per decode
    step use the hardware better (the demo runs 256), but the engine's KV cache holds rows x the longest
    row, so its memory grows in proportion. None: 64; on CUDA for the embedded engine, every sample a step
    has in flight (`prompts_per_step x group_size x (generation_lag + 1)`, at most 1024)."""
    memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """On CUDA, the share of the GPU's memory the run's memory plan may fill when it sizes the embedded
    engine's KV cache (`max_batch_tokens` unset); vLLM's own share is `vllm.gpu_memory_utilization`."""
    request_timeout_s: float = Field(120.0, gt=0)
    """Per-request timeout for remote inference."""
    weights_dir: str | None = None
    """Folder the trainer and an inference server (`--weights-dir`) both read: weights are synced as files
    there instead of streamed over HTTP."""
    weight_sync_timeout_s: float = Field(300.0, gt=0)
    """Longest a weight sync to an inference server may take before the run stops with an error."""
    weight_update: Literal["wait", "abort", "in_flight"] = "wait"
    """What a weight sync does with requests in flight: `wait` lets them finish on the old weights first (each
    sample generated by one version; new requests wait); `abort` cuts them short (finish_reason "abort");
    `in_flight` loads the new weights between two decode steps and running requests go on with them, keeping
    the KV cache of their tokens so far (each token records its version). In flight needs the embedded engine
    or llmrl's server (`llmrl serve-inference --weight-update in_flight`); vLLM runs it as `wait`, with a
    notice (docs/training.md)."""
    weight_sync_bucket_mb: int = Field(512, ge=1)
    """Most megabytes of weights moved as one bucket (a decoder layer larger than that is one bucket): under
    torchrun, gathered at once from the shards for rank 0's inference side (and for a checkpoint), each handed
    over before the next is gathered, so rank 0 never holds a second full copy; to vLLM (`http` or `disk`),
    sent in one update request or file. It bounds each bucket, not the memory of a vLLM sync: the trainer
    keeps the whole last synced copy (a restarted server gets it) and the server holds the update until it is
    complete. One process hands the engine its own weights, uncopied."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """vLLM servers (type `vllm`)."""
    generation: GenerationArgs = Field(default_factory=lambda: GenerationArgs(max_tokens=16))
    """Sampling parameters of rollouts; an environment's `agent_args.generation_args` override them. The
    trainer takes its logprobs with each rollout's own options (temperature, min_p, top_k, top_p);
    repetition/presence penalties and min_tokens are for evaluation-only environments."""

    @property
    def resolved_max_batch_tokens(self) -> int:
        """`max_batch_tokens`, or the embedded engine's budget on CPU when it is unset."""
        return self.max_batch_tokens if self.max_batch_tokens is not None else DEFAULT_ENGINE_TOKENS

    @property
    def resolved_max_concurrent(self) -> int:
        """`max_concurrent`, or the default when it is unset (the run sizes it on CUDA before this is read)."""
        return self.max_concurrent if self.max_concurrent is not None else DEFAULT_CONCURRENT

    @property
    def in_every_process(self) -> bool:
        """Whether every process of a torchrun run holds an engine (colocated vLLM), rather than rank 0 alone."""
        return self.type == "vllm" and self.vllm.mode == "colocate"

    @model_validator(mode="before")
    @classmethod
    def _renamed_pause_mode(cls, data: Any) -> Any:
        """`inference.vllm.pause_mode` (configs saved before `weight_update` served every backend) still
        loads, as `weight_update` where that is not set."""
        return _moved_out_of_vllm(
            data, "pause_mode", "weight_update", "one setting for every backend", lambda old, current: current
        )

    @model_validator(mode="before")
    @classmethod
    def _renamed_bucket_setting(cls, data: Any) -> Any:
        """`inference.vllm.bucket_mb` (configs saved before it became `weight_sync_bucket_mb`) still
        loads: the smaller of the two sizes, so that each bound the run had still holds."""

        def smaller(old: Any, current: Any) -> Any:
            return min(old, current) if isinstance(old, int) and isinstance(current, int) else old

        return _moved_out_of_vllm(
            data, "bucket_mb", "weight_sync_bucket_mb", "one bucket size for every weight transfer", smaller
        )


def _moved_out_of_vllm(
    data: Any, old_name: str, new_name: str, why: str, merge: Callable[[Any, Any], Any]
) -> Any:
    """The inference section `data` with `vllm.<old_name>` moved to `<new_name>`, with a warning; where
    both are set, the value is `merge(old, current)`."""
    vllm = data.get("vllm") if isinstance(data, dict) else None
    if not isinstance(vllm, dict) or old_name not in vllm:
        return data
    vllm = dict(vllm)
    old = vllm.pop(old_name)
    value = merge(old, data[new_name]) if new_name in data else old
    log.warning(
        "inference.vllm.%s is now inference.%s (%s); read as %s: %s", old_name, new_name, why, new_name, value
    )
    return data | {"vllm": vllm, new_name: value}


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


class DistillationConfig(Section):
    """On-policy distillation (docs/algorithms.md): a teacher scores every position the policy samples,
    and the policy is trained to lower its per-token reverse KL to the teacher there. The teacher must
    share the policy's tokenizer."""

    teacher: str
    """The teacher: anything `model.spec` takes (`tiny://NAME`, a local folder, a hub id), or a run or
    checkpoint folder of an earlier llmrl run (its latest checkpoint's model; a LoRA run's adapter merged
    onto its base)."""
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
    """Dtype the teacher is loaded and run in; None: `model.dtype`."""
    rewards: Literal["add", "ignore"] = "add"
    """`add`: the environments' group advantages train the policy too, beside the distillation term (an
    environment without rewards gives equal rewards, hence zero group advantages, and distillation
    alone); `ignore`: the teacher alone trains the policy."""


class TrainingConfig(Section):
    steps: int = Field(40, ge=0)
    """Number of RL steps (rollout collection + policy update)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompt groups per step."""
    group_size: int = Field(8, ge=1)
    """Completions sampled per prompt (the GRPO group)."""
    lr: float = Field(2e-5, gt=0.0)
    """Peak learning rate of AdamW."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this; None disables clipping."""
    iterations: int = Field(1, ge=1)
    """Optimisation passes over each step's rollouts (PPO epochs)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass: the rollouts are split into this many mini-batches."""
    micro_batch_tokens: int = Field(4096, ge=1)
    """Token budget of one forward/backward micro-batch (rows x row width, padding included); bounds
    activation memory."""
    pack_row_tokens: int = Field(512, ge=1)
    """Longest packed row (rollouts laid end to end); a rollout longer than this gets a row of its own.
    Each step picks the row length up to this (and whether to share prompts) by estimated FLOPs:
    attention over a row costs its length squared with the sdpa/eager kernels."""
    share_prefixes: bool = True
    """Allow a prompt to be encoded once for several of its rollouts (an attention mask keeps the
    samples apart): same loss and gradients, fewer tokens; used when it makes a step cheaper, never
    for models with sliding-window attention layers."""
    generation_lag: int = Field(0, ge=0)
    """Steps generation runs ahead of training: batch t is generated with the weights of step t-1-lag while
    earlier steps train (0 = on-policy, no overlap)."""
    partial_rollouts: bool = False
    """With a lag: generate continuously, one group at a time, keeping up to (lag + 1) x prompts_per_step groups
    generating or waiting; each step trains on the first `prompts_per_step` groups to complete, and a group
    that misses a batch goes into a later one (never dropped for being slow). Batches then depend on timing:
    runs are not bitwise repeatable (docs/training.md)."""
    max_staleness: int | None = Field(None, ge=1)
    """With partial rollouts: most weight versions a group's oldest token may be behind the policy it trains;
    a complete group older than that is generated again for the same problem (`rollout/stale_regenerated`).
    At least `generation_lag`. None: no bound."""
    max_inference_failure_frac: float | None = Field(None, ge=0.0, lt=1.0)
    """Largest fraction of a batch's rollouts that may fail in inference (server unreachable, refused, timed
    out); a batch over it is neither banked nor trained on, and the run stops so that a rerun regenerates it.
    None: stop when any whole group failed in inference."""
    max_user_failure_frac: float | None = Field(0.5, ge=0.0, lt=1.0)
    """Largest fraction of rollouts that may fail in user code (a reward function or `reward`/`observe`
    that raises or returns no finite number, an agent program that raises or makes no model call), averaged
    over the last 3 steps; over it, the run stops with exit status 1 and one line naming the most frequent
    failure, before that step trains. A step whose rollouts all failed in user code always stops the run.
    None: only such a step does."""
    deterministic: bool = True
    """Use deterministic kernels so that the same config gives the same numbers."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the policy trains; `auto` picks CUDA when available."""
    master_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the policy's weights, gradients and optimizer state (the master weights). float32 keeps small
    updates that a bfloat16 weight would round away (at lr 1e-6 most of them); setting it to `model.dtype`
    halves that memory at this cost. Either float32 or the same as `model.dtype`."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations during the backward pass instead of keeping them: same loss
    and gradients, less memory, for about one more forward pass of time (docs/training.md)."""
    tf32: bool = True
    """Let CUDA float32 matmuls and convolutions use TF32 tensor cores (about 10 mantissa bits in the
    products); no effect on CPU."""


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


class CheckpointConfig(Section):
    every: int = Field(20, ge=0)
    """Save every N steps (0 = only at the end)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted."""
    save_optimizer: bool = True
    """Include optimizer and scheduler state (needed for exact resume)."""


class LoggingConfig(Section):
    tensorboard: bool = True
    """Write TensorBoard event files to the run folder."""
    wandb: bool = False
    """Log to Weights & Biases (needs the `wandb` extra)."""
    wandb_project: str = "llmrl"
    """W&B project name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """W&B mode; offline writes locally and can be synced later, disabled makes every call a no-op."""
    rollouts_per_step: int = Field(8, ge=0)
    """Rollouts written to rollouts.jsonl per step (text, reward)."""
    trace: bool = True
    """Record a Chrome-trace/Perfetto timeline of the run's phases."""
    progress: Literal["auto", "rich", "plain", "off"] = "auto"
    """Progress display: a rich bar on a terminal, plain lines otherwise."""

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false


class RunConfig(Section):
    seed: int = 0
    """Seed of every random choice in the run (sampling, problem order, initialisation)."""
    run_dir: str = "runs/demo"
    """Folder for metrics, logs, plots and checkpoints; a relative one is relative to the working directory
    (not to the config file's folder)."""
    plugins: list[str] = Field(default_factory=list)
    """Python modules (or `.py` files, imported under their file name) imported before building agents, so
    they can register their own types and provide reward functions (`module:function`). A module name is
    looked for beside the config file (as `NAME.py`, or a package folder `NAME/`, for a name without dots),
    then on the import path, then in the working directory. Only honoured for configs read from a local
    file, never for one received over the network."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """How rollouts are generated."""
    environments: list[EnvironmentConfig] = Field(min_length=1)
    """Environments to train and evaluate on."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimator and loss."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """Optimisation schedule."""
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    """Held-out evaluation."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics, logs and traces."""
    distillation: DistillationConfig | None = None
    """On-policy distillation from a teacher model (`DistillationConfig`); None (absent): off."""

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if not any(env.weight > 0 and not env.evaluation_only for env in self.environments):
            raise ValueError(
                "environments: at least one environment needs weight > 0 and evaluation_only false"
            )
        names = [env.name for env in self.environments]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"environments: env ids must be unique, repeated: {duplicates} (set env_id)")
        training = self.training
        if training.group_size < 2:
            raise ValueError(
                "training.group_size: 1 leaves every rollout alone in its group, so its baseline is its own "
                "reward and every advantage is 0 (nothing is learned); use 2 or more"
            )
        if training.master_dtype not in ("float32", self.model.dtype):
            raise ValueError(
                f"training.master_dtype: {training.master_dtype!r} must be float32 or model.dtype "
                f"({self.model.dtype!r}): weights are kept at least as precise as the compute"
            )
        if self.model.dtype == "float16" and training.master_dtype == "float32":
            raise ValueError(
                "model.dtype: float16 compute over float32 master weights needs loss scaling, which llmrl does "
                "not do (float16 gradients underflow without it); use bfloat16, or training.master_dtype: float16"
            )
        self._check_colocation()
        self._check_partial_rollouts()
        if (
            self.model.lora is not None
            and self.inference.type == "vllm"
            and self.inference.vllm.mode == "servers"
        ):
            if self.model.lora.rank > VLLM_LORA_RANKS[-1]:
                raise ValueError(
                    f"model.lora.rank: {self.model.lora.rank} is more than vLLM serves ({VLLM_LORA_RANKS[-1]})"
                )
        if training.mini_batches > training.prompts_per_step * training.group_size:
            raise ValueError(
                f"training.mini_batches: {training.mini_batches} is more than the "
                f"{training.prompts_per_step * training.group_size} rollouts of a step"
            )
        if training.micro_batch_tokens <= self.inference.generation.max_tokens:
            raise ValueError(
                f"training.micro_batch_tokens: {training.micro_batch_tokens} tokens cannot hold one rollout of "
                f"inference.generation.max_tokens={self.inference.generation.max_tokens} completion tokens "
                "plus its prompt; raise it"
            )
        for index, env in enumerate(self.environments):
            self._check_trainable_sampling(index, env)
        too_big = [k for k in self.evaluation.ks if k > self.evaluation.samples_per_prompt or k < 1]
        if too_big:
            raise ValueError(
                f"evaluation.ks: every k must be in 1..samples_per_prompt "
                f"({self.evaluation.samples_per_prompt}), got {too_big}"
            )
        return self

    def _check_partial_rollouts(self) -> None:
        training = self.training
        if training.max_staleness is not None and not training.partial_rollouts:
            raise ValueError(
                "training.max_staleness: only partial rollouts carry groups over to later steps; without them "
                "a token is at most training.generation_lag versions old"
            )
        if not training.partial_rollouts:
            return
        if training.generation_lag < 1:
            raise ValueError(
                "training.partial_rollouts: needs training.generation_lag >= 1 (with no lag every batch is "
                "generated whole before its step)"
            )
        if training.max_staleness is not None and training.max_staleness < training.generation_lag:
            raise ValueError(
                f"training.max_staleness: {training.max_staleness} is below training.generation_lag "
                f"({training.generation_lag}), which makes every token that old by design"
            )
        if self.algorithm.dynamic_sampling:
            raise ValueError(
                "algorithm.dynamic_sampling: not with training.partial_rollouts (groups are drawn one at a "
                "time; a group without signal still trains)"
            )

    def _check_colocation(self) -> None:
        vllm = self.inference.vllm
        if vllm.mode != "colocate" or self.inference.type != "vllm":
            if vllm.sleep_level:
                raise ValueError(
                    "inference.vllm.sleep_level: only a colocated engine sleeps (vllm.mode: colocate)"
                )
            return
        if self.inference.base_url:
            raise ValueError(
                "inference.base_url: a colocated engine runs in the trainer's process; unset it, or use "
                "inference.vllm.mode: servers to train from the servers at it"
            )
        if vllm.sleep_level and self.training.generation_lag:
            raise ValueError(
                f"inference.vllm.sleep_level: an engine asleep during updates cannot generate ahead "
                f"(training.generation_lag: {self.training.generation_lag}); set one of them to 0"
            )

    def inference_for_run(self) -> InferenceConfig:
        """The inference section as this run builds it, with what depends on other sections resolved:
        a LoRA run's vLLM adapter slots (`VLLMConfig.resolved_max_loras`) follow the generation lag."""
        if self.model.lora is None or self.inference.type != "vllm":
            return self.inference
        slots = self.inference.vllm.resolved_max_loras(self.training.generation_lag)
        vllm = self.inference.vllm.model_copy(update={"max_loras": slots})
        return self.inference.model_copy(update={"vllm": vllm})

    def _check_trainable_sampling(self, index: int, env: EnvironmentConfig) -> None:
        """A trained environment's sampling options must be ones the trainer's logprobs can follow."""
        own = env.agent_args.get("generation_args")
        if env.evaluation_only or env.weight == 0 or not isinstance(own, dict | None):
            return
        try:
            args = self.inference.generation.merge(own)
        except ValidationError:
            return  # the agent reports its own bad generation_args, naming the field
        where = f"environments[{index}] ({env.name})"
        if args.temperature == 0:
            raise ValueError(f"{where}: temperature 0 (greedy) leaves no distribution to train on")
        if args.untrainable_options:
            raise ValueError(
                f"{where}: {args.untrainable_options} change the sampled distribution in ways the trainer "
                "cannot reproduce in its logprobs; use them only with evaluation_only: true"
            )


DEMO_CONFIG = Path(__file__).with_name("demo.yaml")
"""The built-in demo's config file, what ``llmrl train`` runs when given none (examples/arithmetic.yaml
links to it)."""


def demo_config() -> RunConfig:
    """The built-in demo (`DEMO_CONFIG`): the tiny model learns 2-digit addition with GRPO."""
    return load_config(None)


# ---------------------------------------------------------------------------------------------
# Loading, overrides and error messages


_EXPECTED = {
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "int_parsing": "expected an integer",
    "int_type": "expected an integer",
    "int_from_float": "expected an integer",
    "bool_parsing": "expected true or false",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
}


def _dotted(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or "<root>"


def _known_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names valid at `loc` (the parent of an unknown key), for 'did you mean' hints."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        nested, _ = _section_type(field.annotation)
        if nested is None:
            return []
        model = nested
    return list(model.model_fields)


def _describe(error: dict[str, Any], model: type[BaseModel]) -> str:
    path = _dotted(error["loc"])
    kind = error["type"]
    given = error.get("input")
    if kind == "extra_forbidden":
        parent = error["loc"][:-1]
        known = _known_fields(model, parent)
        hint = difflib.get_close_matches(str(error["loc"][-1]), known, n=1)
        message = f"{path}: unknown key"
        if hint:
            message += f" (did you mean '{_dotted((*parent, hint[0]))}'?)"
        elif known:
            message += f"; valid keys here: {', '.join(known)}"
        return message
    if kind == "missing":
        return f"{path}: required field is missing"
    if kind in _EXPECTED:
        return f"{path}: {_EXPECTED[kind]}, got {given!r}"
    if kind == "literal_error":
        return f"{path}: expected one of {error['ctx']['expected']}, got {given!r}"
    message = error["msg"].removeprefix("Value error, ")
    if path == "<root>":
        return message
    return (
        f"{path}: {message}, got {given!r}"
        if "input" in error and not isinstance(given, dict)
        else f"{path}: {message}"
    )


def _raise_config_error(exc: ValidationError, source: str | None, model: type[BaseModel]) -> None:
    where = f" (in {source})" if source else ""
    lines = [_describe(e, model) + where for e in exc.errors()]
    raise ConfigError("\n".join(lines)) from None


_LIST_INDEX = re.compile(r"\[(\d+)\]")
"""``environments[0]``: the way errors name a list item, accepted in keys as ``environments.0``."""


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into (["a", "b", "c"], parsed YAML value); ``a[0].b`` is ``a.0.b``."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected key=value, e.g. training.lr=1e-5")
    path = _LIST_INDEX.sub(r".\1", key.strip()).split(".")
    if any(not part for part in path):
        raise ConfigError(f"--set {assignment!r}: empty component in key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {assignment!r}: value is not valid YAML: {exc}") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with each ``key=value`` override applied (lists indexed by number)."""
    data = _copy_containers(data)
    for assignment in overrides:
        path, value = parse_override(assignment)
        node: Any = data
        for depth, part in enumerate(path[:-1]):
            where = ".".join(path[: depth + 1])
            if isinstance(node, list):
                node = node[_list_index(part, node, where, assignment)]
            else:
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
                if not isinstance(child, (dict, list)):
                    raise ConfigError(f"--set {assignment!r}: {where} is a value, not a section")
                node = child
        last = path[-1]
        if isinstance(node, list):
            node[_list_index(last, node, ".".join(path), assignment)] = value
        else:
            node[last] = value
    return data


def _copy_containers(value: Any) -> Any:
    """A copy of the mappings and lists of `value` that shares everything else: the objects a config built
    in Python holds (a function, a dataset) stay the objects themselves."""
    if isinstance(value, dict):
        return {key: _copy_containers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_containers(item) for item in value]
    return value


def _list_index(part: str, node: list[Any], where: str, assignment: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"--set {assignment!r}: {where} needs an index 0..{len(node) - 1}")
    return int(part)


def config_from_dict(data: dict[str, Any], source: str | None = None) -> RunConfig:
    """Validate a plain mapping into a RunConfig; errors name each bad field and `source`."""
    if not isinstance(data, dict):
        where = f" (in {source})" if source else ""
        raise ConfigError(f"<root>: expected a mapping of sections, got {type(data).__name__}{where}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        _raise_config_error(exc, source, RunConfig)
        raise AssertionError("unreachable") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or the built-in demo when `path` is None) and apply ``--set`` overrides."""
    source = "built-in demo config" if path is None else str(path)
    path = DEMO_CONFIG if path is None else Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if isinstance(data, dict):
        data = _found_beside(data, path.parent)
    if overrides:
        if not isinstance(data, dict):
            raise ConfigError(f"<root>: expected a mapping of sections (in {source})")
        data = apply_overrides(data, overrides)
        source += " with --set overrides"
    return config_from_dict(data, source)


AGENT_INPUT_PATHS = ("path", "data_files", "eval_data_files", "chat_template")
"""The `agent_args` that name files an agent reads (a hub dataset's `path` may also be a local folder)."""


def _found_beside(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """`data` with the relative input paths that exist in `folder` (the config file's) made paths from
    the working directory; the others stay relative to the working directory. Output folders (run_dir,
    inference.weights_dir) are left alone."""
    if folder.resolve() == Path.cwd().resolve():
        return data

    def located(value: Any) -> Any:
        if isinstance(value, list):
            return [located(item) for item in value]
        if isinstance(value, str) and value and not Path(value).is_absolute() and (folder / value).exists():
            return str(folder / value)
        return value

    def located_plugin(entry: Any) -> Any:
        if not isinstance(entry, str) or entry.endswith(".py"):
            return located(entry)
        if not entry.isidentifier():  # a dotted module name: from the import path or the working directory
            return entry
        for candidate in (folder / f"{entry}.py", folder / entry / "__init__.py"):
            if candidate.is_file():
                return str(candidate)
        return entry

    data = _copy_containers(data)
    if isinstance(data.get("plugins"), list):
        data["plugins"] = [located_plugin(entry) for entry in data["plugins"]]
    model = data.get("model")
    if isinstance(model, dict) and "spec" in model:
        model["spec"] = located(model["spec"])
    distillation = data.get("distillation")
    if isinstance(distillation, dict) and "teacher" in distillation:
        distillation["teacher"] = located(distillation["teacher"])
    inference = data.get("inference")
    vllm = inference.get("vllm") if isinstance(inference, dict) else None
    if isinstance(vllm, dict) and "python" in vllm:
        vllm["python"] = located(vllm["python"])
    for environment in data.get("environments") or []:
        arguments = environment.get("agent_args") if isinstance(environment, dict) else None
        if isinstance(arguments, dict):
            for key in AGENT_INPUT_PATHS:
                if key in arguments:
                    arguments[key] = located(arguments[key])
    return data


def dump_config(config: RunConfig) -> str:
    """The fully resolved config as YAML (every field, defaults included). A config built in Python
    writes its objects' descriptions (`describe_python_object`), and says so in a first comment."""
    data = config.model_dump(mode="json")
    text = yaml.safe_dump(data, sort_keys=False)
    if not _holds_python_objects(data):
        return text
    return (
        "# Built in Python (llmrl.train): each value written <...> stands for an object the run was given,\n"
        "# so this file does not load as it is; the same Python call resumes the run.\n" + text
    )


def _holds_python_objects(data: Any) -> bool:
    if isinstance(data, dict):
        return any(_holds_python_objects(value) for value in data.values())
    if isinstance(data, list):
        return any(_holds_python_objects(value) for value in data)
    return is_python_object_description(data)


def reference_markdown() -> str:
    """docs/configuration.md: every section and field with its type, default and docstring."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from llmrl/config.py by `python -m llmrl.config > docs/configuration.md`. -->",
        "",
        "A run is one YAML file; every field below can also be set with `--set section.field=value`",
        "(list items by number: `--set environments.0.agent_args.digits=3`, or `environments[0]`).",
        "`llmrl config show CONFIG` prints a config with all defaults filled in. From Python,",
        "`llmrl.train(config)` takes a file, a mapping or a `RunConfig` (docs/python_api.md).",
        "",
        "Relative paths of the files a run reads (`plugins`, `model.spec`, `distillation.teacher`,",
        "`inference.vllm.python`, and an",
        f"environment's {', '.join(f'`{name}`' for name in AGENT_INPUT_PATHS)}) resolve against the config",
        "file's folder when the file exists there, otherwise against the working directory. The folders a",
        "run writes (`run_dir`, `inference.weights_dir`) are relative to the working directory.",
    ]
    pending: list[tuple[str, type[BaseModel], str | None]] = [("top level", RunConfig, None)]
    while pending:
        title, model, description = pending.pop(0)
        lines += ["", f"## {title}", ""]
        if description:
            lines += [_one_line(description), ""]
        lines += ["| field | default | description |", "|---|---|---|"]
        prefix = "" if model is RunConfig else title.strip("`") + "."
        for name, field in model.model_fields.items():
            nested, is_list = _section_type(field.annotation)
            if nested is None or is_list or field.default is None:  # an optional section gets a row too
                lines.append(f"| `{name}` | {_default_text(field)} | {_one_line(field.description)} |")
            if nested is not None:
                pending.append((f"`{prefix}{name}{'[]' if is_list else ''}`", nested, field.description))
    return "\n".join(lines) + "\n"


def _section_type(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field nests (directly, as list items or optionally), and whether it is a list."""
    options = [a for a in get_args(annotation) if a is not type(None)]
    if type(None) in get_args(annotation) and len(options) == 1:
        annotation = options[0]
    is_list = get_origin(annotation) is list
    if is_list:
        annotation = get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, is_list
    return None, False


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_defaults=True) or "defaults"
        return f"`{value}`"
    return f"`{yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}`"


if __name__ == "__main__":
    print(reference_markdown(), end="")
