"""A verifiers environment (examples/verifiers_sums.py, a vf.MultiTurnEnv with a vf.Rubric) trains on the
embedded engine: its own rollouts and rubric, the sampled tokens trained, the rubric's functions logged."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from llmrl.config import config_from_dict
from llmrl.telemetry import read_metrics
from llmrl.trainer import Trainer

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_tiny_model_trains_on_a_verifiers_environment(tmp_path, tiny_model_path):
    config = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "plugins": [str(EXAMPLES / "verifiers_sums.py")],
            "environments": [
                {
                    "agent_type": "verifiers",
                    "env_id": "sums",
                    "agent_args": {
                        "environment": "verifiers_sums:load_environment",
                        "environment_args": {"max_turns": 2},
                        "max_calls": 2,
                    },
                }
            ],
            "inference": {"max_concurrent": 256},
            "training": {"steps": 3, "prompts_per_step": 8, "group_size": 4, "lr": 3e-4},
            "evaluation": {
                "every": 0,
                "at_start": False,
                "num_prompts": 4,
                "samples_per_prompt": 2,
                "ks": [1],
            },
            "checkpoint": {"every": 0},
            "logging": {"progress": "off", "tensorboard": False, "trace": False},
        }
    )
    try:
        summary = Trainer(config, progress_stream=open(os.devnull, "w")).run()  # noqa: SIM115
    finally:
        sys.modules.pop("verifiers_sums", None)
    rows = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/mismatch_kl" in m]
    assert len(rows) == 3
    for row in rows:
        assert row["rollout/placeholder_frac"] == 0.0
        assert abs(row["train/mismatch_kl"]) < 1e-6  # the trained tokens are the sampled ones
        assert row["reward/sums/mean"] == pytest.approx(row["reward/sums/correct_answer"])
        assert 1.0 <= row["reward/sums/num_turns"] <= 2.0
    assert 0.0 <= summary["eval_end"]["sums"]["pass@1"] <= 1.0
