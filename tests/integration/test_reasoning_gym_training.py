"""A short run of the trainer on a reasoning-gym task: the tiny model trains on chain sums, the task's own
scores are its rewards, logged per task, and the held-out problems are evaluated at the end."""

from __future__ import annotations

import os

import pytest

from llmrl.config import config_from_dict
from llmrl.telemetry import read_metrics
from llmrl.trainer import Trainer

pytestmark = pytest.mark.slow


def test_the_tiny_model_trains_on_a_reasoning_gym_task(tmp_path, tiny_model_path):
    config = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "model": {"spec": "tiny://arithmetic"},
            "environments": [
                {
                    "agent_type": "reasoning_gym",
                    "env_id": "sums",
                    "agent_args": {
                        "dataset": "chain_sum",
                        "config": {"max_terms": 3},
                        "size": 64,
                        "eval_size": 8,
                    },
                }
            ],
            "inference": {"max_concurrent": 64, "generation": {"max_tokens": 16}},
            "training": {"steps": 3, "prompts_per_step": 8, "group_size": 4, "lr": 3e-4},
            "evaluation": {
                "every": 0,
                "at_start": False,
                "num_prompts": 8,
                "samples_per_prompt": 2,
                "ks": [1],
            },
            "checkpoint": {"every": 0},
            "logging": {"progress": "off", "tensorboard": False, "trace": False},
        }
    )
    summary = Trainer(config, progress_stream=open(os.devnull, "w")).run()  # noqa: SIM115
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert 0.0 <= row["reward/sums/chain_sum"] <= 1.0
        assert row["reward/sums/mean"] == pytest.approx(row["reward/sums/chain_sum"])
        assert "sums/failures/reward" not in row
    assert 0.0 <= summary["eval_end"]["sums"]["pass@1"] <= 1.0
