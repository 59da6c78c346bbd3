"""A verifiers environment (examples/verifiers_sums.py, a vf.MultiTurnEnv with a vf.Rubric) trains on the
embedded engine: its own rollouts and rubric, the sampled tokens trained, the rubric's functions logged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.short_runs import short_run

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_tiny_model_trains_on_a_verifiers_environment(tmp_path, tiny_model_path):
    environment = {
        "agent_type": "verifiers",
        "env_id": "sums",
        "agent_args": {
            "environment": "verifiers_sums:load_environment",
            "environment_args": {"max_turns": 2},
            "max_calls": 2,
        },
    }
    try:
        summary, rows = short_run(
            tmp_path, environment, plugins=[str(EXAMPLES / "verifiers_sums.py")], max_concurrent=256
        )
    finally:
        sys.modules.pop("verifiers_sums", None)
    for row in rows:
        assert row["rollout/placeholder_frac"] == 0.0
        assert abs(row["train/mismatch_kl"]) < 1e-6  # the trained tokens are the sampled ones
        assert row["reward/sums/mean"] == pytest.approx(row["reward/sums/correct_answer"])
        assert 1.0 <= row["reward/sums/num_turns"] <= 2.0
    assert 0.0 <= summary["eval_end"]["sums"]["pass@1"] <= 1.0
