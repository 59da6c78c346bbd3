"""The policy model: what to load (`ModelConfig`) and, optionally, the LoRA adapters to train over it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from llmrl.config.sections import Section


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
    """`tiny://arithmetic` (the built-in model), a Hugging Face hub id, or a folder: a model folder, or a run
    or checkpoint folder of an earlier llmrl run (its latest checkpoint's model, fixed when the run starts;
    a LoRA run's adapter is first written merged, `llmrl export`). A spec that starts with `.`, `/` or `~` is
    a path; one like `runs/demo` is the folder where there is one, else a hub id (docs/models.md)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype: the forward and backward passes run in it (autocast in one process, FSDP2's mixed
    precision over several), the embedded engine and vLLM serve in it, and checkpoints' Hugging Face folders
    are written in it. The policy's own weights and optimizer state are kept in `training.master_dtype`.
    float32 gives bitwise-reproducible runs on CPU."""
    attn_implementation: Literal["sdpa", "eager", "varlen"] = "sdpa"
    """Attention kernel of the trainer's forwards, passed to transformers. ``varlen`` attends packed rows
    by their sequence boundaries instead of a mask (`llmrl.algorithms.varlen`: torch's variable-length
    flash attention on CUDA, a span-by-span reference elsewhere); it needs ``training.share_prefixes:
    false`` and has not been measured on a GPU yet. The embedded engine serves with ``sdpa`` then."""
    trust_remote_code: bool = False
    """Allow model code from the hub; off unless you trust the repository."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (`LoraConfig`); None (absent): full fine-tuning."""
