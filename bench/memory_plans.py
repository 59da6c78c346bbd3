"""The memory plan per GPU of each real-size example, on the GPUs it is meant for (H100, 80 GB).

    python bench/memory_plans.py [--markdown]

For each example config (read with llmrl's own loader, so the plan follows its `micro_batch_tokens`,
activation checkpointing, compute and master dtypes and KL reference model) and each layout its
header describes (how many training processes), this prints `MemoryPlan.render()`: what one rank's
GPU holds while training, in GB. Inference runs on vLLM servers on other GPUs, so the trainer holds
no engine. `--markdown` prints the summary table used in docs/training.md instead.

The models are built on the meta device from the hand-written configs below (no download, no
memory, well under a second each); they mirror the Hugging Face hub's config.json of each model,
the fields that set parameter counts and activation sizes.

Two figures outside the plan are printed beside it, because they fall on rank 0's host (CPU)
memory only:

- **load**: rank 0 loads the whole model in the master dtype into host memory and broadcasts it
  to every rank's GPU shard by shard (`Distributed.load_model`), a transient peak; no GPU ever
  holds the whole model;
- **host**: each weight sync gathers the weights bucket by bucket onto rank 0's CPU in the compute
  dtype, and the vLLM interface keeps one whole copy of them (the serialised buckets with
  `http`/`disk`, the collected state dict with `nccl`), so rank 0's host memory needs that much.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmrl.config import RunConfig, load_config  # noqa: E402
from llmrl.models.loading import DTYPES  # noqa: E402
from llmrl.models.shape import ModelShape  # noqa: E402
from llmrl.trainer.memory import GB, MemoryPlan, MemorySettings  # noqa: E402

H100_BYTES = 80 * 10**9

# The hub's config.json of each model (here and in bench/gpu.py), the fields that matter here (Qwen2.5 family: 32k-131k context,
# rope theta 1e6, q/k/v biases; biases are counted by the model class itself).
MODEL_CONFIGS: dict[str, dict[str, int | bool]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen2.5-32B": dict(
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        intermediate_size=27648,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class Layout:
    """How an example is laid out on GPUs: the trainer's processes, and the GPUs left to vLLM."""

    example: str
    label: str
    train_gpus: int
    vllm_gpus: int


LAYOUTS = [
    Layout("gsm8k_qwen2.5_1.5b.yaml", "1 node: 4 GPUs train, 4 vLLM servers (TP 1)", 4, 4),
    Layout("gsm8k_qwen2.5_7b.yaml", "1 node: 4 GPUs train, 4 vLLM servers (TP 1)", 4, 4),
    Layout("gsm8k_qwen2.5_7b.yaml", "2 nodes: 8 GPUs train, 8 vLLM servers (TP 1)", 8, 8),
    Layout("grpo_math_qwen32b.yaml", "8 nodes: 32 GPUs train, 8 vLLM servers (TP 4)", 32, 32),
]


def model_shape(spec: str) -> ModelShape:
    """The shape of the hub model `spec`, built on the meta device from its hand-written config."""
    if spec not in MODEL_CONFIGS:
        raise ValueError(f"no hand-written config for {spec!r}; add it to MODEL_CONFIGS")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**MODEL_CONFIGS[spec]))
    return ModelShape.of(model)


def settings_of(config: RunConfig, world_size: int) -> MemorySettings:
    """The plan's settings for `config` over `world_size` training processes (as the trainer builds them)."""
    return MemorySettings(
        master_dtype=DTYPES[config.training.master_dtype],
        compute_dtype=DTYPES[config.model.dtype],
        world_size=world_size,
        micro_batch_tokens=config.training.micro_batch_tokens,
        row_tokens=config.training.pack_row_tokens,
        activation_checkpointing=config.training.activation_checkpointing,
        reference_model=config.algorithm.kl_beta > 0,
        engine_tokens=config.inference.resolved_max_batch_tokens
        if config.inference.type == "local"
        else None,
    )


def plan_of(layout: Layout) -> tuple[RunConfig, MemoryPlan]:
    config = load_config(ROOT / "examples" / layout.example)
    plan = MemoryPlan(
        model_shape(config.model.spec), settings_of(config, layout.train_gpus), "cuda", H100_BYTES, 0
    )
    return config, plan


def rank0_extras(config: RunConfig, plan: MemoryPlan) -> tuple[float, float]:
    """GB of rank 0's transient load into host memory, and of the copy of the weights its host keeps for
    syncs."""
    load = plan.shape.parameters * DTYPES[config.training.master_dtype].itemsize
    return load / GB, plan.shape.parameters * DTYPES[config.model.dtype].itemsize / GB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the summary table only")
    args = parser.parse_args()
    rows = []
    for layout in LAYOUTS:
        config, plan = plan_of(layout)
        load_gb, host_gb = rank0_extras(config, plan)
        rank0, other = plan.total(rank0=True) / GB, plan.total(rank0=False) / GB
        training = config.training
        rows.append(
            f"| `examples/{layout.example}` | {layout.label} | {plan.shape.parameters / 1e9:.2f}B | "
            f"{config.model.dtype} / {training.master_dtype} | {training.micro_batch_tokens} | "
            f"{'on' if training.activation_checkpointing else 'off'} | {rank0:.1f} | {other:.1f} | "
            f"{load_gb:.1f} | {host_gb:.1f} |"
        )
        if not args.markdown:
            print(f"== examples/{layout.example}: {layout.label}")
            print(plan.render())
            fits = "fits" if plan.fits() else "DOES NOT FIT"
            print(
                f"{fits} in {H100_BYTES / GB:.0f} GB per GPU; rank 0's host memory also loads the whole model "
                f"before it is sharded ({load_gb:.1f} GB, transient) and keeps {host_gb:.1f} GB of weights "
                "for weight syncs\n"
            )
    print(
        "| example | layout | parameters | compute / master | micro-batch tokens | checkpointing "
        "| rank 0 GB | other ranks GB | rank 0 host load GB | rank 0 host sync GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
