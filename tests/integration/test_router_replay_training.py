"""Router replay end to end: `examples/arithmetic_moe.yaml` (the upcycled tiny MoE, bfloat16) trains a few
steps with replay and with `observe`, logging how often the trainer's routers part from the engine's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from llmrl.config import load_config
from llmrl.telemetry import read_metrics
from llmrl.trainer import Trainer
from tests.integration.test_distributed import assert_close_weights, weights
from tests.integration.test_distributed import train as train_in_processes
from tests.integration.test_trainer import QUICK, final_weights, kill_after_checkpoint
from tests.integration.test_trainer import llmrl as run_llmrl

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_moe.yaml"


@pytest.mark.parametrize(
    ("replay", "extra"),
    [(True, []), ("observe", []), (True, ["model.lora={rank: 8}"])],
    ids=["replay", "observe", "lora"],
)
def test_the_moe_example_trains_and_logs_routing_disagreement(tmp_path, monkeypatch, replay, extra):
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
            *extra,
        ],
    )
    Trainer(config, progress_stream=open(os.devnull, "w")).run()  # noqa: SIM115
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert len(rows) == 3
    shares = [row["train/routing/differs_any_layer"] for row in rows]
    assert all(0 <= share < 0.5 for share in shares)
    if not extra:  # bfloat16 compute flips some routes; a LoRA run's frozen bfloat16 base may flip none
        assert max(shares) > 0
    for row in rows:
        assert row["train/routing/differs_any_layer"] >= max(
            row[f"train/routing/differs_layer_{i}"] for i in range(4)
        )


def test_router_replay_over_two_processes_trains_like_one(tmp_path, monkeypatch):
    """FSDP2: each rank lays out its share's routes; the counts are summed over the ranks."""
    monkeypatch.setenv("LLMRL_CACHE", str(tmp_path / "cache"))
    moe = ("model.spec=tiny://arithmetic-moe", "training.router_replay=true", "training.steps=2")
    runs = {processes: tmp_path / f"processes_{processes}" for processes in (1, 2)}
    for processes, folder in runs.items():
        folder.mkdir()
        train_in_processes(folder / "run", processes, *moe)
    one, two = (read_metrics(folder / "run" / "metrics.jsonl") for folder in runs.values())
    assert [r["train/loss"] for r in two] == pytest.approx([r["train/loss"] for r in one], rel=1e-5, abs=1e-7)
    for row_one, row_two in zip(one, two, strict=True):
        assert row_two["train/routing/differs_any_layer"] == pytest.approx(
            row_one["train/routing/differs_any_layer"]
        )
    assert_close_weights(weights(runs[2] / "run", 2), weights(runs[1] / "run", 2))


def test_a_killed_replay_run_resumes_with_the_banked_routes_and_ends_the_same(tmp_path, monkeypatch):
    """With a generation lag the batches generated ahead are banked, routes and all, and trained after the
    resume on the routes they were sampled with."""
    monkeypatch.setenv("LLMRL_CACHE", str(tmp_path / "cache"))
    settings = [
        *QUICK,
        "training.steps=3",
        "training.generation_lag=1",
        "checkpoint.every=1",
        "evaluation.every=0",
        "evaluation.at_end=false",
    ]
    argv = ["train", str(EXAMPLE), *[a for s in settings for a in ("--set", s)]]
    whole = run_llmrl(*argv, "--set", f"run_dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    killed = tmp_path / "killed"
    kill_after_checkpoint(argv, killed, 1)
    resumed = run_llmrl(*argv, "--set", f"run_dir={killed}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "generated before the interruption" in resumed.stdout
    expected, actual = final_weights(tmp_path / "whole"), final_weights(killed)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    whole_rows, resumed_rows = (read_metrics(run / "metrics.jsonl") for run in (tmp_path / "whole", killed))
    key = "train/routing/differs_any_layer"
    assert [r.get(key) for r in resumed_rows] == [r.get(key) for r in whole_rows]
    assert sum(key in r for r in whole_rows) == 3
