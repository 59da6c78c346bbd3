"""Short runs of the trainer on reasoning-gym tasks: the tiny model trains on chain sums, the task's own
scores are its rewards, logged per task, and the held-out problems are evaluated at the end; in a
multi-task mix (with arithmetic under a generation lag, or with a verifiers environment) evaluated with
pass@k, a run stopped by a dead inference server resumes to the numbers of an uninterrupted one."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmrl import registry
from llmrl.inference import Health
from llmrl.inference.interface import InferenceUnavailableError
from llmrl.rollouts import RolloutBank
from tests.integration.short_runs import (
    VERIFIERS_SUMS,
    failures,
    logged_rollouts,
    short_run,
    short_run_config,
    train,
    trainer,
)

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

CHAIN_SUMS = {
    "agent_type": "reasoning_gym",
    "env_id": "sums",
    "agent_args": {"dataset": "chain_sum", "config": {"max_terms": 3}, "size": 64, "eval_size": 8},
}


def test_the_tiny_model_trains_on_a_reasoning_gym_task(tmp_path, tiny_model_path):
    summary, rows = short_run(tmp_path, CHAIN_SUMS, generation={"max_tokens": 16})
    for row in rows:
        assert 0.0 <= row["reward/sums/chain_sum"] <= 1.0
        assert row["reward/sums/mean"] == pytest.approx(row["reward/sums/chain_sum"])
        assert not failures(row, "sums")
    assert 0.0 <= summary["eval_end"]["sums"]["pass@1"] <= 1.0


class DyingInference:
    """The run's inference, failing like an unreachable server once it serves the weights of step
    `from_version`."""

    def __init__(self, inference, from_version: int):
        self.inference = inference
        self.from_version = from_version
        self.lost_at: float | None = None

    async def agenerate(self, request):
        if self.inference.policy_version >= self.from_version:
            self.lost_at = self.lost_at or time.time()
            raise ConnectionRefusedError("[Errno 111] Connection refused")
        return await self.inference.agenerate(request)

    def health(self):
        return Health(servers=("http://10.0.0.7:8000/v1",), unreachable_since=self.lost_at)

    def __getattr__(self, name: str):
        return getattr(self.inference, name)


@pytest.fixture
def plugins(monkeypatch):
    """The config's plug-ins are imported for the test only."""
    monkeypatch.setattr(registry, "_plugin_modules", set())
    yield
    sys.modules.pop("verifiers_sums", None)


ARITHMETIC = {"agent_type": "arithmetic", "agent_args": {"eval_size": 4}}


# A verifiers environment without a lag: with one, the loss weighs each token by the engine's logprob
# (importance sampling), and the engine's logprobs differ in their last bits with the shape of the batch
# they are computed in (tests/unit/test_engine.py); a verifiers episode's turns reach the engine at
# moments that depend on timing, so two uninterrupted runs would differ in the 7th digit already.
@pytest.mark.parametrize(
    ("partner", "lag"), [(ARITHMETIC, 1), (VERIFIERS_SUMS, 0)], ids=["arithmetic", "verifiers"]
)
def test_a_reasoning_gym_task_in_a_mix_resumes_to_the_numbers_of_an_uninterrupted_run(
    tmp_path, tiny_model_path, plugins, partner, lag
):
    """reasoning-gym and another agent in one multi-task mix, evaluated with pass@k: rollouts record the
    weights they were generated with, and a run stopped by a dead inference server resumes to the numbers
    of an uninterrupted one, bit for bit (the agents' problem orders restored from the checkpoint)."""
    tasks = {"sums", partner.get("env_id", partner["agent_type"])}
    settings = {
        "training": {"steps": 4, "prompts_per_step": 8, "group_size": 4, "lr": 3e-4, "generation_lag": lag},
        "evaluation": {
            "every": 0,
            "at_start": False,
            "num_prompts": 4,
            "samples_per_prompt": 2,
            "ks": [1, 2],
        },
        "checkpoint": {"every": 1},
        "logging": {"progress": "off", "tensorboard": False, "trace": False, "rollouts_per_step": 1000},
    }

    def config(name):
        return short_run_config(
            tmp_path / name,
            [CHAIN_SUMS, partner],
            plugins=[str(EXAMPLES / "verifiers_sums.py")] if partner is VERIFIERS_SUMS else [],
            settings=settings,
            max_concurrent=256,
            generation={"max_tokens": 16},
        )

    summary, rows = train(config("whole"))
    for row in rows:
        assert {f"reward/{task}/mean" for task in tasks} <= set(row)  # both tasks in every batch
        assert row["rollout/placeholder_frac"] == 0.0
    # Batch t is generated with the weights of step t-1-lag: each rollout records them.
    assert [row["rollout/staleness_max"] for row in rows] == [min(step - 1, lag) for step in (1, 2, 3, 4)]
    rollouts = logged_rollouts(tmp_path / "whole")
    assert {r["env_id"] for r in rollouts} == tasks
    assert all(r["policy_version"] == r["newest_version"] == max(0, r["step"] - 1 - lag) for r in rollouts)
    for task in tasks:
        evaluation = summary["eval_end"][task]
        assert 0.0 <= evaluation["pass@1"] <= evaluation["pass@2"] <= 1.0

    # The same run, its inference lost as it generates the batch of step 3 (with the weights of step
    # 2 - lag): the run stops before it checkpoints a step newer than those weights, and a lag's batch
    # generated ahead (step 2's) waits in the bank.
    stopped = trainer(config("stopped"))
    stopped.inference = DyingInference(stopped.inference, from_version=2 - lag)
    with pytest.raises(InferenceUnavailableError, match="batch of step 3: 32 of 32 rollouts failed"):
        stopped.run()
    assert [b.step for b in RolloutBank(tmp_path / "stopped").read()] == ([2] if lag else [])

    resumed = trainer(config("stopped"))
    assert resumed.resumed and resumed.step == 2 - lag
    resumed_summary, resumed_rows = train(resumed)
    assert logged_rollouts(tmp_path / "stopped") == rollouts  # the same problems, completions, rewards
    assert [row["train/loss"] for row in resumed_rows] == [row["train/loss"] for row in rows]
    assert resumed_summary["eval_end"] == summary["eval_end"]
    expected, actual = (
        load_file(tmp_path / name / "checkpoints" / "step_000004" / "model" / "model.safetensors")
        for name in ("whole", "stopped")
    )
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
