"""The models a run trains with, loaded the way its mode needs: the policy (full weights or LoRA
adapters over a frozen base, in one process or sharded over several), its tokenizer, the KL
reference and the distillation teacher; and the memory plan checked before any of them loads.

Loading knows the mode so that the trainer does not: one process loads the model itself, several
receive their shards of the model rank 0 loads (`Distributed.load_model`); a LoRA run wraps the base
in `Adapters` before it is sharded; a resumed run starts from its checkpoint's weights (the model
folder and, in one process, its master weights; a LoRA run's adapter folder; a multi-process run's
shards are restored with the optimizer, `llmrl.trainer.checkpointer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from llmrl.config import ConfigError, InferenceConfig, RunConfig
from llmrl.errors import UserError
from llmrl.inference.served_teacher import ServedTeacher
from llmrl.models import load_model
from llmrl.models.loading import DTYPES, enable_activation_checkpointing
from llmrl.models.reward_model import reward_models_bytes
from llmrl.models.shape import ModelShape, tied_duplicates
from llmrl.trainer import checkpoint as ckpt
from llmrl.trainer.distributed import Distributed
from llmrl.trainer.evaluated_model import EvaluatedModel, find_evaluated_model
from llmrl.trainer.lora import ADAPTER_FOLDER, Adapters, adapter_sizes
from llmrl.trainer.memory import (
    ColocatedEngine,
    LoraSizes,
    MemoryPlan,
    MemorySettings,
    plan_memory,
    size_engine,
)


@dataclasses.dataclass
class PolicyModels:
    """The policy and what comes with it."""

    policy: torch.nn.Module
    """What trains: it holds the master weights, or the float32 adapters over the frozen base."""
    tokenizer: Any
    compute_dtype: torch.dtype
    """The dtype of the forward and backward passes (`model.dtype`) and of the weights served and saved."""
    adapters: Adapters | None
    """LoRA runs only."""
    reference: torch.nn.Module | None
    """The KL reference as a model of its own; None with LoRA (the policy with its adapters off is)."""
    reference_context: Callable[[], contextlib.AbstractContextManager[None]] | None
    """With LoRA and a KL penalty: inside it the policy is the reference."""
    tied_names: set[str]
    """State-dict names aliasing another entry (tied embeddings): sent and saved once, under the first name."""
    teacher: torch.nn.Module | None = None
    """The distillation teacher (`distillation.teacher`), frozen; None without one in process."""
    teacher_server: ServedTeacher | None = None
    """The client of a served distillation teacher (`distillation.teacher_server`); None without one."""

    def untied_state_dict(self) -> dict[str, torch.Tensor]:
        """One process's policy weights, each tensor once."""
        return {
            name: value for name, value in self.policy.state_dict().items() if name not in self.tied_names
        }


class _Loader:
    """`load_model` in one process; over several, each rank's shards of the model rank 0 loads."""

    def __init__(self, config: RunConfig, device: str, distributed: Distributed | None):
        self.distributed = distributed
        self.options = {
            "device": device,
            "attn_implementation": config.model.attn_implementation,
            "trust_remote_code": config.model.trust_remote_code,
        }

    def __call__(
        self,
        spec: str,
        dtype: str,
        compute_dtype: torch.dtype | None = None,
        prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    ) -> tuple[Any, Any]:
        if self.distributed is None:
            model, tokenizer = load_model(spec, dtype=dtype, **self.options)
            return prepare(model) if prepare else model, tokenizer
        return self.distributed.load_model(
            spec, dtype=dtype, compute_dtype=compute_dtype, prepare=prepare, **self.options
        )


def load_policy(
    config: RunConfig, device: str, distributed: Distributed | None, checkpoint: Path | None
) -> PolicyModels:
    """The policy of `config`, from `checkpoint` when the run resumes, and its KL reference."""
    load = _Loader(config, device, distributed)
    compute_dtype = DTYPES[config.model.dtype]
    if config.model.lora is None:
        policy, tokenizer = load(
            str(checkpoint / "model") if checkpoint else config.model.spec,
            config.training.master_dtype,
            compute_dtype if config.model.dtype != config.training.master_dtype else None,
        )
        if checkpoint and distributed is None:
            ckpt.load_master_weights(checkpoint, policy)
        adapters = None
    else:
        policy, tokenizer, adapters = _load_with_adapters(load, config, compute_dtype, checkpoint)
    if config.training.activation_checkpointing:
        enable_activation_checkpointing(policy)
    policy.train()
    reference = None
    kl = config.algorithm.kl_beta > 0
    # Loaded once, never per step; no master copy: it never changes. With LoRA: the policy, adapters off.
    if kl and adapters is None:
        reference, _ = load(config.model.spec, config.model.dtype)
        reference.eval().requires_grad_(False)
    return PolicyModels(
        policy=policy,
        tokenizer=tokenizer,
        compute_dtype=compute_dtype,
        adapters=adapters,
        reference=reference,
        reference_context=adapters.disabled if adapters is not None and kl else None,
        tied_names=tied_duplicates(policy),
        teacher=_load_teacher(load, config, tokenizer) if _loads_teacher(config) else None,
        teacher_server=_teacher_server(config),
    )


def _loads_teacher(config: RunConfig) -> bool:
    return config.distillation is not None and config.distillation.teacher is not None


def _teacher_server(config: RunConfig) -> ServedTeacher | None:
    served = config.distillation.teacher_server if config.distillation is not None else None
    return ServedTeacher.from_config(served) if served is not None else None


def _load_teacher(load: _Loader, config: RunConfig, tokenizer: Any) -> torch.nn.Module:
    """`distillation.teacher`, frozen: a run or checkpoint folder stands for its model (a LoRA run's
    adapter merged onto its base, in a temporary folder removed once loaded). Its tokenizer must be the
    policy's, or its logprobs would score other tokens than those sampled."""
    distillation = config.distillation
    assert distillation is not None
    dtype = distillation.teacher_dtype or config.model.dtype
    found = _teacher(config)
    with found.served(config.model.model_copy(update={"dtype": dtype})) as settings:
        teacher, teacher_tokenizer = load(settings.spec, dtype)
    mismatch = tokenizer_mismatch(tokenizer, teacher_tokenizer)
    if mismatch is not None:
        raise ConfigError(
            f"distillation.teacher: {distillation.teacher}'s tokenizer is not that of model.spec "
            f"{config.model.spec} ({mismatch}); a teacher must score the very tokens the policy samples"
        )
    return teacher.eval().requires_grad_(False)


def tokenizer_mismatch(policy_tokenizer: Any, teacher_tokenizer: Any) -> str | None:
    """How the teacher's tokenizer differs from the policy's, in words, or None when they agree on
    every token id."""
    policy_size, teacher_size = len(policy_tokenizer), len(teacher_tokenizer)
    if policy_size != teacher_size:
        return f"vocab size {teacher_size} in the teacher, {policy_size} in the policy"
    policy_tokens = {index: token for token, index in policy_tokenizer.get_vocab().items()}
    teacher_tokens = {index: token for token, index in teacher_tokenizer.get_vocab().items()}
    for index in sorted(policy_tokens.keys() | teacher_tokens.keys()):
        if policy_tokens.get(index) != teacher_tokens.get(index):
            return (
                f"token {index} is {teacher_tokens.get(index)!r} in the teacher, "
                f"{policy_tokens.get(index)!r} in the policy"
            )
    return None


def _load_with_adapters(
    load: _Loader, config: RunConfig, compute_dtype: torch.dtype, checkpoint: Path | None
) -> tuple[torch.nn.Module, Any, Adapters]:
    """The frozen base in the compute dtype, float32 adapters over it."""
    lora = config.model.lora
    assert lora is not None
    built: list[Adapters] = []

    def with_adapters(base: torch.nn.Module) -> torch.nn.Module:
        # Over several processes the meta-built model's adapters are built last and kept: they are
        # the ones sharded; rank 0's loaded ones reach them with the base weights.
        adapters = Adapters(base, lora)
        built.append(adapters)
        if checkpoint and not next(base.parameters()).is_meta:
            adapters.load(checkpoint / ADAPTER_FOLDER)
        return adapters.model

    # Sharded units cast the float32 adapters to the compute dtype for the passes, as one process's
    # autocast does.
    adapters_cast = compute_dtype if compute_dtype != torch.float32 else None
    policy, tokenizer = load(config.model.spec, config.model.dtype, adapters_cast, prepare=with_adapters)
    return policy, tokenizer, built[-1]


def colocated_engine(inference: InferenceConfig) -> ColocatedEngine | None:
    vllm = inference.vllm
    if inference.type != "vllm" or vllm.mode != "colocate":
        return None
    return ColocatedEngine(
        vllm.gpu_memory_utilization, vllm.cpu_kv_cache_gib << 30, sleeps=vllm.sleep_level > 0
    )


def plan_training_memory(config: RunConfig, device: str, distributed: Distributed | None) -> MemoryPlan:
    """What training `config` will hold in memory on each process, from the model's shapes alone."""
    settings = MemorySettings(
        master_dtype=DTYPES[config.training.master_dtype],
        compute_dtype=DTYPES[config.model.dtype],
        world_size=1 if distributed is None else distributed.world_size,
        micro_batch_tokens=config.training.micro_batch_tokens,
        row_tokens=config.training.pack_row_tokens,
        activation_checkpointing=config.training.activation_checkpointing,
        reference_model=config.algorithm.kl_beta > 0 and config.model.lora is None,
        engine_tokens=config.inference.resolved_max_batch_tokens
        if config.inference.type == "local"
        else None,
        colocated=colocated_engine(config.inference),
    )

    def shapes() -> torch.nn.Module:
        model, _ = load_model(
            config.model.spec, device="meta", trust_remote_code=config.model.trust_remote_code
        )
        return model

    if config.model.lora is not None:
        settings = dataclasses.replace(settings, lora=LoraSizes(*adapter_sizes(shapes(), config.model.lora)))
    if _loads_teacher(config):  # a served teacher takes none of the trainer's memory
        settings = dataclasses.replace(settings, teacher_bytes=_teacher_bytes(config))
    reward_models = [
        entry
        for environment in config.environments
        for entry in environment.agent_args.get("reward_functions") or []
        if isinstance(entry, Mapping) and "model" in entry
    ]
    settings = dataclasses.replace(settings, reward_model_bytes=reward_models_bytes(reward_models, device))
    plan = plan_memory(shapes(), settings, device)
    if device == "cuda" and config.inference.type == "local":
        training = config.training
        plan = size_engine(
            plan,
            max_batch_tokens=config.inference.max_batch_tokens,
            max_concurrent=config.inference.max_concurrent,
            rows_in_flight=training.prompts_per_step * training.group_size * (training.generation_lag + 1),
            utilization=config.inference.memory_utilization,
        )
    return plan


def _teacher_bytes(config: RunConfig) -> int:
    """The distillation teacher's weights in its dtype, from its shapes alone (a LoRA run's teacher: its
    base, the adapters merged into it)."""
    distillation = config.distillation
    assert distillation is not None
    spec = _teacher(config).spec
    try:
        teacher, _ = load_model(spec, device="meta", trust_remote_code=config.model.trust_remote_code)
    except UserError as error:
        raise ConfigError(f"distillation.teacher: {error}") from None
    dtype = DTYPES[distillation.teacher_dtype or config.model.dtype]
    return ModelShape.of(teacher).parameters * dtype.itemsize


def _teacher(config: RunConfig) -> EvaluatedModel:
    """What `distillation.teacher` names (`llmrl.trainer.evaluated_model`), or a `ConfigError` saying why not."""
    assert config.distillation is not None and config.distillation.teacher is not None
    try:
        return find_evaluated_model(config.distillation.teacher)
    except UserError as error:
        raise ConfigError(f"distillation.teacher: {error}") from None
