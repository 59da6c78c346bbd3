"""Router replay end to end: `examples/arithmetic_moe.yaml` (the upcycled tiny MoE, bfloat16) trains a few
steps with replay and with `observe`, logging how often the trainer's routers part from the engine's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmrl.config import load_config
from llmrl.telemetry import read_metrics
from llmrl.trainer import Trainer

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_moe.yaml"


@pytest.mark.parametrize("replay", [True, "observe"])
def test_the_moe_example_trains_and_logs_routing_disagreement(tmp_path, monkeypatch, replay):
    monkeypatch.setenv("LLMRL_CACHE", str(tmp_path / "cache"))
    config = load_config(
        EXAMPLE,
        overrides=[
            f"run_dir={tmp_path / 'run'}",
            "training.steps=3",
            "training.prompts_per_step=8",
            f"training.router_replay={str(replay).lower()}",
            "evaluation.at_start=false",
            "evaluation.at_end=false",
            "checkpoint.every=0",
            "logging.progress=off",
        ],
    )
    Trainer(config, progress_stream=open(os.devnull, "w")).run()  # noqa: SIM115
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert len(rows) == 3
    for row in rows:
        assert 0 < row["train/routing/differs_any_layer"] < 0.5  # bfloat16 flips some routes, not most
        assert row["train/routing/differs_any_layer"] >= max(
            row[f"train/routing/differs_layer_{i}"] for i in range(4)
        )
