"""On-policy distillation end to end on the tiny model: a teacher trained by an earlier run, exact resume,
and two processes against one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from llmrl.telemetry import read_metrics
from tests.integration.test_distributed import assert_close_weights, losses, weights
from tests.integration.test_distributed import train as train_in_processes
from tests.integration.test_trainer import final_weights, train

pytestmark = pytest.mark.slow

NO_EVALUATION = ["evaluation.at_start=false", "evaluation.at_end=false"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_model_path) -> Path:
    """A run folder whose model two quick steps moved away from the tiny model's."""
    run_dir = tmp_path_factory.mktemp("teacher")
    train(run_dir, "training.steps=2", "training.lr=1e-3", *NO_EVALUATION)
    return run_dir


def reverse_kls(run_dir: Path, key: str = "distill/reverse_kl") -> list[float]:
    """The run's reverse KL to the teacher per step: the sampled estimate, or `train/teacher_kl` (top k)."""
    return [row[key] for row in read_metrics(run_dir / "metrics.jsonl") if key in row]


def test_a_resumed_distillation_run_ends_with_the_same_weights(tmp_path, teacher):
    settings = [f"distillation.teacher={teacher}", "training.lr=1e-4", *NO_EVALUATION]
    train(tmp_path / "whole", "training.steps=4", *settings)
    train(tmp_path / "resumed", "training.steps=2", *settings)
    train(tmp_path / "resumed", "training.steps=4", *settings)
    expected, actual = final_weights(tmp_path / "whole"), final_weights(tmp_path / "resumed")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    whole, resumed = reverse_kls(tmp_path / "whole"), reverse_kls(tmp_path / "resumed")
    assert resumed == whole and len(whole) == 4
    assert min(whole) > 1e-3  # the teacher differs from the student: the compared signal is real
    rows = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    assert all(row["distill/arithmetic/reverse_kl"] == row["distill/reverse_kl"] for row in rows)


def test_two_processes_distill_like_one(tmp_path, teacher):
    for processes in (1, 2):
        train_in_processes(tmp_path / str(processes), processes, f"distillation.teacher={teacher}")
    assert losses(tmp_path / "2") == pytest.approx(losses(tmp_path / "1"), rel=1e-5, abs=1e-7)
    assert reverse_kls(tmp_path / "2") == pytest.approx(reverse_kls(tmp_path / "1"), rel=1e-5, abs=1e-7)
    assert min(reverse_kls(tmp_path / "1")) > 1e-3
    top_k = [reverse_kls(tmp_path / str(processes), "train/teacher_kl") for processes in (1, 2)]
    assert top_k[1] == pytest.approx(top_k[0], rel=1e-5, abs=1e-7) and min(top_k[0]) > 1e-3
    assert_close_weights(weights(tmp_path / "2"), weights(tmp_path / "1"))


def test_a_run_folder_as_model_spec_starts_from_its_latest_checkpoint_also_when_resumed(tmp_path, teacher):
    settings = [f"model.spec={teacher}", *NO_EVALUATION]
    train(tmp_path / "next", "training.steps=1", *settings)
    saved = yaml.safe_load(next((tmp_path / "next" / "checkpoints").glob("step_*/config.yaml")).read_text())
    assert saved["model"]["spec"] == str(teacher / "checkpoints" / "step_000002" / "model")
    train(tmp_path / "next", "training.steps=2", *settings)  # the same spec resumes: it names the same folder
    assert [row["step"] for row in read_metrics(tmp_path / "next" / "metrics.jsonl")] == [1, 2]
