"""An agent program with no llmrl import (examples/retry_agent.py) trains on the embedded engine."""

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


def train_retry_program(run_dir: Path, *, inference: dict, evaluation: dict) -> list[dict]:
    """Three steps of examples/retry_agent.py on the sums data; the metrics of the steps that trained."""
    config = config_from_dict(
        {
            "run_dir": str(run_dir),
            "plugins": [str(EXAMPLES / "retry_agent.py")],
            "environments": [
                {
                    "agent_type": "openai_agent",
                    "agent_args": {
                        "rollout": "retry_agent:rollout",
                        "data_files": str(EXAMPLES / "data" / "sums_train.jsonl"),
                        "eval_data_files": str(EXAMPLES / "data" / "sums_test.jsonl"),
                        "max_calls": 3,
                    },
                }
            ],
            "inference": inference,
            "training": {"steps": 3, "prompts_per_step": 8, "group_size": 4, "lr": 3e-4},
            "evaluation": evaluation,
            "checkpoint": {"every": 0},
            "logging": {"progress": "off", "tensorboard": False, "trace": False},
        }
    )
    try:
        Trainer(config, progress_stream=open(os.devnull, "w")).run()  # noqa: SIM115
    finally:
        sys.modules.pop("retry_agent", None)
    return [m for m in read_metrics(run_dir / "metrics.jsonl") if "train/mismatch_kl" in m]


def test_retry_program_trains_on_the_sampled_tokens(tmp_path, tiny_model_path):
    evaluation = {"every": 0, "at_start": False, "num_prompts": 8, "samples_per_prompt": 2, "ks": [1]}
    steps = train_retry_program(tmp_path / "run", inference={"max_concurrent": 256}, evaluation=evaluation)
    assert len(steps) == 3
    for metrics in steps:
        assert metrics["rollout/placeholder_frac"] == 0.0
        assert abs(metrics["train/mismatch_kl"]) < 1e-6  # the trained tokens are the sampled ones
        assert 1.0 <= metrics["reward/openai_agent/calls"] <= 3.0
