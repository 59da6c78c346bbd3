"""A short training run of one environment (or a mix) on the tiny model, as the ecosystem environments' tests
run them (3 steps of 8 prompts x 4, a small final evaluation, nothing else written unless asked)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from llmrl.config import RunConfig, config_from_dict
from llmrl.telemetry import read_jsonl, read_metrics
from llmrl.trainer import Trainer

STEPS = 3
VERIFIERS_SUMS = {
    "agent_type": "verifiers",
    "env_id": "vf-sums",
    "agent_args": {
        "environment": "verifiers_sums:load_environment",
        "environment_args": {"max_turns": 2},
        "max_calls": 2,
        "eval_size": 4,
    },
}
"""examples/verifiers_sums.py's multi-turn environment, as the mixes below train it."""


def short_run_config(
    run_dir: Path,
    environment: dict[str, Any] | list[dict[str, Any]],
    *,
    plugins: list[str] | None = None,
    settings: dict[str, dict[str, Any]] | None = None,
    **inference: Any,
) -> RunConfig:
    """The config of a short run into `run_dir`: `environment` (or a list of them: a multi-task mix);
    `settings`: fields of the config's sections over the short run's (``{"training": {"steps": 4}}``);
    `inference`: settings of the inference section beside a decode batch of 64."""
    sections: dict[str, Any] = {
        "run_dir": str(run_dir),
        "model": {"spec": "tiny://arithmetic"},
        "plugins": plugins or [],
        "environments": environment if isinstance(environment, list) else [environment],
        "inference": {"max_concurrent": 64, **inference},
        "training": {"steps": STEPS, "prompts_per_step": 8, "group_size": 4, "lr": 3e-4},
        "evaluation": {"every": 0, "at_start": False, "num_prompts": 8, "samples_per_prompt": 2, "ks": [1]},
        "checkpoint": {"every": 0},
        "logging": {"progress": "off", "tensorboard": False, "trace": False},
    }
    sections = copy.deepcopy(sections)
    for section, fields in (settings or {}).items():
        sections[section].update(fields)
    return config_from_dict(sections)


def trainer(config: RunConfig) -> Trainer:
    """The trainer of `config`, its progress display silenced."""
    return Trainer(config, progress_stream=open(os.devnull, "w"))  # noqa: SIM115


def train(run: RunConfig | Trainer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the run's summary, its training steps' rows) after training `run` (a config, or its trainer) to
    its last step."""
    run = trainer(run) if isinstance(run, RunConfig) else run
    summary = run.run()
    rows = [row for row in read_metrics(Path(run.config.run_dir) / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == list(range(1, run.config.training.steps + 1))  # each once
    return summary, rows


def short_run(
    tmp_path: Path,
    environment: dict[str, Any] | list[dict[str, Any]],
    *,
    plugins: list[str] | None = None,
    settings: dict[str, dict[str, Any]] | None = None,
    **inference: Any,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the run's summary, its step rows), after the short run of `environment` in ``tmp_path/run``
    (`short_run_config`)."""
    return train(
        short_run_config(tmp_path / "run", environment, plugins=plugins, settings=settings, **inference)
    )


def logged_rollouts(run_dir: Path) -> list[dict[str, Any]]:
    """The rollouts the run logged (`logging.rollouts_per_step` a step)."""
    return read_jsonl(run_dir / "rollouts.jsonl")


def failures(row: dict[str, Any], env_id: str) -> list[str]:
    """The environment's failure counters in a step's row."""
    return [key for key in row if key.startswith(f"agents/{env_id}/failures/")]
