"""A short training run of one environment on the tiny model, as the ecosystem environments' tests run
them (3 steps of 8 prompts x 4, a small final evaluation, nothing else written)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmrl.config import config_from_dict
from llmrl.telemetry import read_metrics
from llmrl.trainer import Trainer

STEPS = 3


def short_run(
    tmp_path: Path, environment: dict[str, Any], *, plugins: list[str] | None = None, **inference: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the run's summary, its step rows), after `STEPS` steps of `environment`; `inference`: settings of
    the inference section beside a decode batch of 64."""
    config = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "model": {"spec": "tiny://arithmetic"},
            "plugins": plugins or [],
            "environments": [environment],
            "inference": {"max_concurrent": 64, **inference},
            "training": {"steps": STEPS, "prompts_per_step": 8, "group_size": 4, "lr": 3e-4},
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
    rows = [row for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in row]
    assert len(rows) == STEPS
    return summary, rows


def failures(row: dict[str, Any], env_id: str) -> list[str]:
    """The environment's failure counters in a step's row."""
    return [key for key in row if key.startswith(f"agents/{env_id}/failures/")]
