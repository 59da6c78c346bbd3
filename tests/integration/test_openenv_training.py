"""A short run of the trainer against an OpenEnv environment: the tiny model plays examples/openenv_sums.py
(served by llmrl from the plug-in, in its own process), the environment's step rewards are the rewards,
and the held-out seeds are evaluated at the end."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from llmrl import registry
from llmrl.config import config_from_dict
from llmrl.telemetry import read_metrics
from llmrl.trainer import Trainer

pytest.importorskip("openenv.core")
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openenv_sums.py"


@pytest.fixture
def plugins(monkeypatch):
    monkeypatch.setattr(registry, "_plugin_modules", set())
    yield
    sys.modules.pop("openenv_sums", None)


def test_the_tiny_model_trains_against_an_openenv_environment(tmp_path, tiny_model_path, plugins):
    config = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "model": {"spec": "tiny://arithmetic"},
            "plugins": [str(EXAMPLE)],
            "environments": [
                {
                    "agent_type": "openenv",
                    "env_id": "sums",
                    "agent_args": {
                        "serve": {"module": "openenv_sums:app"},
                        "observation_to_messages": "openenv_sums:observation_to_messages",
                        "completion_to_action": "openenv_sums:completion_to_action",
                        "max_turns": 3,
                        "max_sessions": 64,
                        "num_problems": 64,
                        "eval_size": 8,
                    },
                }
            ],
            "inference": {"max_concurrent": 64, "generation": {"max_tokens": 8}},
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
        assert 0.0 <= row["reward/sums/mean"] <= 1.0  # one right answer ends an episode with reward 1
        assert not [key for key in row if key.startswith("sums/failures/")]
    assert 0.0 <= summary["eval_end"]["sums"]["pass@1"] <= 1.0
