"""LoRA runs end to end on the tiny model: adapter-only syncs and checkpoints, the KL reference with the
adapters off, exact resume, and the saved adapter in peft and merged by ``llmrl export``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmrl.config import load_config
from llmrl.models import load_model
from llmrl.telemetry import read_metrics
from llmrl.trainer import Trainer

pytestmark = pytest.mark.slow

LORA = [
    "model.lora={rank: 8, alpha: 16}",
    "training.prompts_per_step=8",
    "training.lr=3e-3",
    "training.lr_schedule=constant",
    "algorithm.kl_beta=0.05",
    "evaluation.at_start=false",
    "evaluation.at_end=false",
    "logging.progress=plain",
    "logging.tensorboard=false",
]


def train(run_dir: Path, *overrides: str) -> dict:
    config = load_config(None, [f"run_dir={run_dir}", *LORA, *overrides])
    return Trainer(config, progress_stream=open(os.devnull, "w")).run()  # noqa: SIM115


def adapter(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "adapter" / "adapter_model.safetensors")


@pytest.mark.cross_cpu
def test_a_lora_run_syncs_and_saves_the_adapter_alone_and_resumes_exactly(tmp_path):
    whole = tmp_path / "whole"
    train(whole, "training.steps=4", "checkpoint.every=2")
    rows = read_metrics(whole / "metrics.jsonl")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter(whole, 4).values())
    base_bytes = sum(p.numel() * p.element_size() for p in load_model("tiny://arithmetic")[0].parameters())
    for row in rows:
        assert row["sync/bytes"] == adapter_bytes < base_bytes / 4
        assert abs(row["train/mismatch_kl"]) < 1e-4  # the engine serves the merged adapter
    assert rows[0]["train/ref_kl"] == 0 < rows[-1]["train/ref_kl"]  # B starts at zero: the policy is the base
    folder = whole / "checkpoints" / "step_000004"
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter",
        "config.yaml",
        "manifest.json",
        "trainer_state.pt",
    ]

    resumed = tmp_path / "resumed"
    train(resumed, "training.steps=2", "checkpoint.every=2")
    train(resumed, "training.steps=4", "checkpoint.every=2")
    assert all(torch.equal(value, adapter(whole, 4)[name]) for name, value in adapter(resumed, 4).items())


def test_the_saved_adapter_loads_in_peft_and_export_merges_it(tmp_path):
    from peft import PeftModel

    run = tmp_path / "run"
    train(run, "training.steps=2")
    trained = Trainer(load_config(run / "config.yaml"), progress_stream=open(os.devnull, "w"))  # noqa: SIM115
    try:
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
        with torch.no_grad():
            expected = trained.policy(input_ids=ids).logits
            base, _ = load_model("tiny://arithmetic")
            folder = run / "checkpoints" / "step_000002" / "adapter"
            assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
            assert torch.equal(PeftModel.from_pretrained(base, str(folder))(input_ids=ids).logits, expected)
            export = subprocess.run(
                [sys.executable, "-m", "llmrl", "export", str(run), str(tmp_path / "merged")],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert export.returncode == 0, export.stderr
            merged, _ = load_model(str(tmp_path / "merged"))
            assert torch.allclose(merged(input_ids=ids).logits, expected, atol=1e-4)
    finally:
        trained._close_inference()
    # A run from the LoRA run starts from the same merged model, written into its own folder.
    train(tmp_path / "next", f"model.spec={run}", "training.steps=1")
    start = load_config(tmp_path / "next" / "config.yaml").model.spec
    assert Path(start).parent == tmp_path / "next" / "start_models"
    with torch.no_grad():
        assert torch.allclose(load_model(start)[0](input_ids=ids).logits, expected, atol=1e-4)
