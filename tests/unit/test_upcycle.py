"""`tiny://arithmetic-moe`: the tiny dense model upcycled into a Qwen2-MoE, built on first use, the same
bytes on every build, and computing the dense model's function when its experts are exact copies."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from llmrl.models import load_model
from llmrl.models.loading import resolve_model_spec
from llmrl.models.routing import moe_routers
from llmrl.models.upcycle import UPCYCLED_MODELS, build, upcycle


def test_exact_copies_of_the_mlp_compute_the_dense_model(tiny_model):
    dense, _ = tiny_model
    recipe = dataclasses.replace(UPCYCLED_MODELS["arithmetic-moe"], expert_noise=0.0)
    moe = upcycle(dense, recipe)
    ids = torch.tensor([[5, 40, 17, 3, 99, 250, 7]])
    with torch.no_grad():
        torch.testing.assert_close(moe(input_ids=ids).logits, dense(input_ids=ids).logits, atol=1e-5, rtol=0)
    assert len(moe_routers(moe)) == dense.config.num_hidden_layers


def test_the_spec_builds_once_into_the_cache_the_same_bytes_every_time(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMRL_CACHE", str(tmp_path / "cache"))
    folder = resolve_model_spec("tiny://arithmetic-moe")
    assert folder.startswith(str(tmp_path / "cache" / "tiny" / "arithmetic-moe-"))
    written = (tmp_path / "cache" / "tiny").iterdir()
    assert [p.name for p in written] == [folder.rsplit("/", 1)[1]]  # no half-built folder left
    assert resolve_model_spec("tiny://arithmetic-moe") == folder  # reused
    again = tmp_path / "again"
    again.mkdir()
    build(UPCYCLED_MODELS["arithmetic-moe"], again)
    assert (again / "model.safetensors").read_bytes() == (Path(folder) / "model.safetensors").read_bytes()
    model, tokenizer = load_model("tiny://arithmetic-moe")
    assert type(model).__name__ == "Qwen2MoeForCausalLM" and tokenizer.chat_template
