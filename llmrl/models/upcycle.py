"""A small mixture-of-experts model made from the tiny dense one: ``tiny://arithmetic-moe``.

Upcycling (as in sparse upcycling, Komatsuzaki et al. 2022) turns each MLP of `tiny://arithmetic` (a
Qwen2) into a Qwen2-MoE block of `experts` copies of it, each perturbed by seeded noise of
`expert_noise` times the weight's own standard deviation, with a router of seeded random weights
choosing `top_k` of them per token (their weights renormalised to sum to 1). The shared expert
Qwen2-MoE adds is zero. With equal copies the model would compute the dense one's function whatever
the router chose; the noise makes the experts differ, as a trained MoE's do, so that routing flips
(bfloat16 rounding, an engine's kernels) move logprobs the way router replay is about, while the model
still does most of the dense one's task (held-out pass@1 0.24 against the dense model's 0.26).

The build is arithmetic on the shipped weights with a seeded CPU generator, so every machine makes
the same bytes: it is made on first use into the cache folder (`$LLMRL_CACHE`, default
``~/.cache/llmrl``) under a name that carries its recipe, and reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from llmrl.models.tiny import BUILD_INFO, tiny_model_path


@dataclasses.dataclass(frozen=True)
class UpcycleRecipe:
    """Everything that determines an upcycled model's bytes."""

    source: str = "arithmetic"
    """The `tiny://` dense model whose MLPs become experts."""
    experts: int = 4
    top_k: int = 2
    expert_noise: float = 0.3
    """Each expert's weights are the MLP's plus this times their standard deviation of Gaussian noise."""
    router_scale: float = 0.1
    """Standard deviation of the router's random weights."""
    seed: int = 0

    @property
    def recipe_id(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


UPCYCLED_MODELS: dict[str, UpcycleRecipe] = {"arithmetic-moe": UpcycleRecipe()}
"""`tiny://` names built by upcycling on first use."""


def cache_root() -> Path:
    return Path(os.environ.get("LLMRL_CACHE") or Path.home() / ".cache" / "llmrl")


def upcycled_model_path(name: str) -> Path:
    """The folder of `tiny://name`, built into the cache if it is not there yet."""
    recipe = UPCYCLED_MODELS[name]
    folder = cache_root() / "tiny" / f"{name}-{recipe.recipe_id}"
    if not (folder / BUILD_INFO).is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
        try:
            build(recipe, building)
            try:
                building.rename(folder)
            except OSError:  # another process built it first: the same bytes
                if not (folder / BUILD_INFO).is_file():
                    raise
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return folder


def build(recipe: UpcycleRecipe, folder: Path) -> None:
    """Upcycle `recipe.source` into `folder` (a model folder with its tokenizer)."""
    source = tiny_model_path(recipe.source)
    dense = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    moe = upcycle(dense, recipe)
    moe.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    (folder / BUILD_INFO).write_text(
        json.dumps({"recipe_id": recipe.recipe_id, "recipe": dataclasses.asdict(recipe)}, indent=2) + "\n"
    )


def upcycle(dense: transformers.PreTrainedModel, recipe: UpcycleRecipe) -> transformers.PreTrainedModel:
    """A Qwen2-MoE whose attention, norms and embeddings are `dense`'s (a Qwen2) and whose every MLP is
    `recipe.experts` noisy copies of `dense`'s, routed top-`recipe.top_k`."""
    settings = dense.config.to_dict()
    for key in ("architectures", "model_type", "transformers_version", "dtype"):
        settings.pop(key, None)
    config = transformers.Qwen2MoeConfig(
        **settings,
        num_experts=recipe.experts,
        num_experts_per_tok=recipe.top_k,
        moe_intermediate_size=dense.config.intermediate_size,
        shared_expert_intermediate_size=1,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
    )
    torch.manual_seed(recipe.seed)  # the layers' initial values, all replaced below
    moe = transformers.Qwen2MoeForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(recipe.seed)

    def noisy(weight: torch.Tensor) -> torch.Tensor:
        noise = torch.randn((recipe.experts, *weight.shape), generator=generator)
        return weight[None] + recipe.expert_noise * weight.std() * noise

    state = {name: tensor for name, tensor in dense.state_dict().items() if ".mlp." not in name}
    for index, layer in enumerate(dense.model.layers):
        mlp, prefix = layer.mlp, f"model.layers.{index}.mlp"
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)
        state[f"{prefix}.experts.gate_up_proj"] = noisy(gate_up)
        state[f"{prefix}.experts.down_proj"] = noisy(mlp.down_proj.weight)
        state[f"{prefix}.gate.weight"] = recipe.router_scale * torch.randn(
            (recipe.experts, config.hidden_size), generator=generator
        )
        block = moe.model.layers[index].mlp
        for name, tensor in block.shared_expert.state_dict().items():
            state[f"{prefix}.shared_expert.{name}"] = torch.zeros_like(tensor)
        state[f"{prefix}.shared_expert_gate.weight"] = torch.zeros_like(block.shared_expert_gate.weight)
    missing, unexpected = moe.load_state_dict(state, strict=False)
    left = [name for name in missing if name != "lm_head.weight"]  # tied to the embeddings
    assert not left and not unexpected, (left, unexpected)
    return moe.eval()
