"""How rollouts are generated: the inference interface (`InferenceConfig`) and vLLM's servers or colocated
engine (`VLLMConfig`); and a model server that llmrl starts for a model it asks, such as a served
distillation teacher (`ServeConfig`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llmrl.config.sections import Section
from llmrl.types import GenerationArgs

log = logging.getLogger(__name__)


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


class ServeConfig(Section):
    """A model server that llmrl starts at the start of the run and stops at its end
    (`llmrl.inference.managed_server`): llmrl's (`llmrl serve-inference`) or vLLM's, on a free port of
    127.0.0.1, logging into the run folder."""

    model: str
    """The model served: anything `model.spec` takes (`tiny://NAME`, a local folder, a hub id), or with
    `engine: llmrl` also a run or checkpoint folder of an earlier llmrl run (vLLM loads model folders: a
    checkpoint's is its `model` folder)."""
    engine: Literal["llmrl", "vllm"] = "llmrl"
    """`llmrl`: `llmrl serve-inference` with this interpreter; `vllm`: vLLM's OpenAI-compatible server, with
    the Python that managed vLLM servers use (`inference.vllm.python`'s search order, without that field)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the server loads and runs the model in (its `--dtype`)."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """Longest the server may take to answer its health route after it starts; then the run stops."""
    extra_args: list[str] = Field(default_factory=list)
    """More command-line arguments for the server, passed through as they are (vLLM:
    `--gpu-memory-utilization 0.3`, `--max-model-len 4096`, ...)."""
    env: dict[str, str] = Field(default_factory=dict)
    """More environment variables for the server, e.g. `CUDA_VISIBLE_DEVICES` to keep it off the trainer's
    GPUs."""


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
    record_routes: bool = False
    """The embedded engine returns, with each completion, the experts a mixture-of-experts model's routers
    chose for every token it read (`InferenceResponse.routed_experts`). A run sets it from
    `training.router_replay`."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """How the embedded engine (and `llmrl serve-inference`) runs its decode steps on a Llama or Qwen2
    model. `on`: over a paged KV cache at fixed batch-size buckets (1, 2, 4, 8, then multiples of 16), each
    captured once as a CUDA graph and replayed, prefill eager; on a CPU the same step runs eagerly, with the
    numbers of `off`. `off`: launched op by op, group prompts shared by cascade attention. `auto`: `off`,
    until graphs have been measured on a card (docs/benchmarks.md)."""
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

    @field_validator("cuda_graphs", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        if isinstance(value, bool):  # YAML reads a bare on/off as true/false
            return "on" if value else "off"
        return value

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
