"""Training from data and rewards written for TRL or verl, and per-environment sampling options, on the tiny
model.

The fixtures (tests/fixtures/layouts) hold the tiny model's addition problems in verl's parquet
layout and TRL's conversational jsonl layout; the reward is a TRL-style function from a plug-in
file. A short run at the demo's settings must raise held-out accuracy.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

from llmrl.config import config_from_dict
from llmrl.telemetry import read_metrics
from llmrl.trainer import Trainer
from tests.integration.servers import serving

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "layouts"
EVALUATION = {"every": 0, "num_prompts": 64, "samples_per_prompt": 8, "ks": [1], "greedy": False}
LOGGING = {"progress": "off", "tensorboard": False, "trace": False}


def run(tmp_path: Path, environment: dict, *, steps: int, evaluation: dict | None = None, **sections) -> dict:
    config = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "plugins": [str(FIXTURES / "arithmetic_rewards.py")],
            "environments": [environment],
            "inference": {"max_concurrent": 256, "generation": {"max_tokens": 16}},
            "training": {"steps": steps, "prompts_per_step": 32, "group_size": 8, "lr": 3e-4},
            "evaluation": evaluation or EVALUATION,
            "checkpoint": {"every": 0},
            "logging": LOGGING,
            **sections,
        }
    )
    try:
        return Trainer(config, progress_stream=open(os.devnull, "w")).run()  # noqa: SIM115
    finally:
        sys.modules.pop("arithmetic_rewards", None)


@pytest.mark.cross_cpu
@pytest.mark.parametrize(
    ("layout", "files", "function"),
    [
        ("verl", ("verl_train.parquet", "verl_test.parquet"), "correct_sum_from_reward_model"),
        ("trl", ("trl_train.jsonl", "trl_test.jsonl"), "correct_sum"),
    ],
)
def test_held_out_accuracy_rises_on_a_layout_with_a_trl_reward_function(
    tmp_path, tiny_model_path, layout, files, function
):
    environment = {
        "agent_type": "dataset",
        "env_id": layout,
        "agent_args": {
            "data_files": str(FIXTURES / files[0]),
            "eval_data_files": str(FIXTURES / files[1]),
            "reward_functions": [{"function": f"arithmetic_rewards:{function}", "weight": 1.0}],
        },
    }
    summary = run(tmp_path, environment, steps=40)
    before, after = summary["eval_start"][layout], summary["eval_end"][layout]
    # Measured on 2 CPU cores: verl 0.289 -> 0.377, trl 0.301 -> 0.439 (about 40-60 s per run).
    assert after["pass@1"] > before["pass@1"] + 0.05, (before, after)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(f"reward/{layout}/{function}" in row for row in rows[1:])


def test_held_out_accuracy_rises_with_an_llm_judge_as_the_reward(tmp_path, tiny_model_path):
    """The judge, a server process behind HTTP, grades every training and evaluation completion."""
    with serving(
        "tests.integration.grading_judge", "--delay-s", "0.01", log_path=tmp_path / "judge.log"
    ) as url:
        environment = {
            "agent_type": "dataset",
            "env_id": "judged",
            "agent_args": {
                "data_files": str(FIXTURES / "trl_train.jsonl"),
                "eval_data_files": str(FIXTURES / "trl_test.jsonl"),
                "answer_column": "solution",
                "reward_functions": [{"judge": {"url": f"{url}/v1", "max_concurrent": 32}}],
            },
        }
        summary = run(tmp_path, environment, steps=40)
    before, after = summary["eval_start"]["judged"], summary["eval_end"]["judged"]
    assert after["pass@1"] > before["pass@1"] + 0.05, (before, after)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(
        "reward/judged/judge" in row and "agents/judged/failures/reward" not in row for row in rows[1:]
    )
    assert all(row["agents/judged/judge/requests"] > 0 for row in rows[1:])


def test_an_environment_with_its_own_sampling_options_trains_on_policy(tmp_path, tiny_model_path):
    """The environment samples at T=0.6 with top-k and min-p while the run's default is T=1: the
    trainer recomputes its logprobs with each rollout's options, so the mismatch is float noise."""
    environment = {
        "agent_type": "arithmetic",
        "agent_args": {"generation_args": {"temperature": 0.6, "top_k": 8, "min_p": 0.01}},
    }
    run(tmp_path, environment, steps=3, evaluation={"at_start": False, "at_end": False})
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert abs(row["train/mismatch_kl"]) < 1e-5, row["train/mismatch_kl"]


def test_a_row_too_long_for_the_context_is_skipped_and_the_run_trains(tmp_path, tiny_model_path, caplog):
    """One prompt of over 2,000 tokens among 40 (the tiny model's context is 1,024): every row is drawn
    in two steps, and without the check at load its request failed and stopped the run for a rerun
    that failed the same way."""
    rows = (FIXTURES / "trl_train.jsonl").read_text().splitlines()[:40]
    long_row = {"prompt": [{"role": "user", "content": "What is 47 + 12? " * 300}], "solution": "59"}
    rows[7] = json.dumps(long_row)
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows) + "\n")
    environment = {
        "agent_type": "dataset",
        "env_id": "sums",
        "agent_args": {
            "data_files": str(data),
            "eval_data_files": str(FIXTURES / "trl_test.jsonl"),
            "reward_functions": [{"function": "arithmetic_rewards:correct_sum", "weight": 1.0}],
        },
    }
    with caplog.at_level(logging.WARNING, logger="llmrl"):
        summary = run(tmp_path, environment, steps=2, evaluation={"at_start": False, "at_end": False})
    assert summary["steps"] == 2
    (line,) = [r.getMessage() for r in caplog.records if "overlong_prompts" in r.getMessage()]
    assert (
        "sums: 1 of 40 training and 0 of " in line
        and f"problem train-7 ({data}, row 7 counting from 0)" in line
    )
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert not any(
        key.endswith("failures/data") or "failures/inference" in key for row in rows for key in row
    )
