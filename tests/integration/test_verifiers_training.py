"""A verifiers environment (examples/verifiers_sums.py, a vf.MultiTurnEnv with a vf.Rubric) trains on the
embedded engine: its own rollouts and rubric, the sampled tokens trained, the rubric's functions logged;
and, mixed with an OpenEnv environment, under a generation lag with in-flight weight updates."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmrl import registry
from tests.integration.short_runs import VERIFIERS_SUMS, logged_rollouts, short_run

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


def test_verifiers_and_openenv_in_a_mix_with_in_flight_updates_record_each_tokens_version(
    tmp_path, tiny_model_path, monkeypatch
):
    """A multi-task mix of both agents generating one step ahead, as groups complete (partial rollouts),
    with the weights updated in flight: every rollout records the versions of its oldest and newest
    tokens within the lag, each step logs their staleness, and held-out pass@k is evaluated for both."""
    monkeypatch.setattr(registry, "_plugin_modules", set())
    environments = [
        VERIFIERS_SUMS,
        {
            "agent_type": "openenv",
            "env_id": "openenv-sums",
            "agent_args": {
                "serve": {"module": "openenv_sums:app"},
                "observation_to_messages": "openenv_sums:observation_to_messages",
                "completion_to_action": "openenv_sums:completion_to_action",
                "max_turns": 2,
                "max_sessions": 64,
                "num_problems": 64,
                "eval_size": 4,
            },
        },
    ]
    settings = {
        "training": {
            "steps": 4,
            "prompts_per_step": 8,
            "group_size": 4,
            "lr": 3e-4,
            "generation_lag": 1,
            "partial_rollouts": True,
            "max_staleness": 1,
        },
        "evaluation": {
            "every": 0,
            "at_start": False,
            "num_prompts": 4,
            "samples_per_prompt": 2,
            "ks": [1, 2],
        },
        "logging": {"progress": "off", "tensorboard": False, "trace": False, "rollouts_per_step": 1000},
    }
    try:
        summary, rows = short_run(
            tmp_path,
            environments,
            plugins=[str(EXAMPLES / "verifiers_sums.py"), str(EXAMPLES / "openenv_sums.py")],
            settings=settings,
            max_concurrent=256,
            weight_update="in_flight",
            generation={"max_tokens": 8},
        )
    finally:
        sys.modules.pop("verifiers_sums", None)
        sys.modules.pop("openenv_sums", None)
    for row in rows:
        assert row["rollout/placeholder_frac"] == 0.0
        ages = {
            int(key.rsplit("/", 1)[1]): share for key, share in row.items() if "rollout/token_age/" in key
        }
        assert sum(ages.values()) == pytest.approx(1.0) and max(ages) <= 1  # max_staleness holds
        assert row["rollout/staleness_max"] == max(age for age, share in ages.items() if share > 0)
    assert any(row["rollout/staleness_max"] == 1 for row in rows)  # a lag: some tokens are a version old
    rollouts = logged_rollouts(tmp_path / "run")
    assert {r["env_id"] for r in rollouts} == {"vf-sums", "openenv-sums"}
    assert len(rollouts) == 4 * 8 * 4  # every rollout of every step
    for rollout in rollouts:
        # The weights of its oldest and newest tokens: never newer than those trained, at most one behind.
        trained = rollout["step"] - 1
        assert trained - 1 <= rollout["policy_version"] <= rollout["newest_version"] <= trained, rollout
    # Episodes running when a sync lands go on with the new weights (about 1 in 9 in a quiet run): how
    # many depends on timing, so none is asserted; the bounds above hold for each.
    for env_id in ("vf-sums", "openenv-sums"):
        evaluation = summary["eval_end"][env_id]
        assert 0.0 <= evaluation["pass@1"] <= evaluation["pass@2"] <= 1.0
