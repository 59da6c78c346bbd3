"""A short run of the trainer against an OpenEnv environment: the tiny model plays examples/openenv_sums.py
(served by llmrl from the plug-in, in its own process), the environment's step rewards are the rewards,
and the held-out seeds are evaluated at the end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmrl import registry
from tests.integration.short_runs import failures, short_run

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openenv_sums.py"


@pytest.fixture
def plugins(monkeypatch):
    monkeypatch.setattr(registry, "_plugin_modules", set())
    yield
    sys.modules.pop("openenv_sums", None)


def test_the_tiny_model_trains_against_an_openenv_environment(tmp_path, tiny_model_path, plugins):
    environment = {
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
    summary, rows = short_run(tmp_path, environment, plugins=[str(EXAMPLE)], generation={"max_tokens": 8})
    for row in rows:
        assert 0.0 <= row["reward/sums/mean"] <= 1.0  # one right answer ends an episode with reward 1
        assert not failures(row, "sums")
    assert 0.0 <= summary["eval_end"]["sums"]["pass@1"] <= 1.0
