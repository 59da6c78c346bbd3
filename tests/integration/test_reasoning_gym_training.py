"""A short run of the trainer on a reasoning-gym task: the tiny model trains on chain sums, the task's own
scores are its rewards, logged per task, and the held-out problems are evaluated at the end."""

from __future__ import annotations

import pytest

from tests.integration.short_runs import failures, short_run

pytestmark = pytest.mark.slow


def test_the_tiny_model_trains_on_a_reasoning_gym_task(tmp_path, tiny_model_path):
    environment = {
        "agent_type": "reasoning_gym",
        "env_id": "sums",
        "agent_args": {"dataset": "chain_sum", "config": {"max_terms": 3}, "size": 64, "eval_size": 8},
    }
    summary, rows = short_run(tmp_path, environment, generation={"max_tokens": 16})
    for row in rows:
        assert 0.0 <= row["reward/sums/chain_sum"] <= 1.0
        assert row["reward/sums/mean"] == pytest.approx(row["reward/sums/chain_sum"])
        assert not failures(row, "sums")
    assert 0.0 <= summary["eval_end"]["sums"]["pass@1"] <= 1.0
