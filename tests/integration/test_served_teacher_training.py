"""A served distillation teacher end to end: the teacher of an earlier run behind `llmrl serve-inference`
trains the tiny model as the same teacher loaded in process does, two processes under torchrun train as
one, and a teacher server that is down stops `llmrl train` with exit status 75 and one line."""

from __future__ import annotations

import pytest

from llmrl import cli
from llmrl.processes import free_port
from llmrl.telemetry import read_metrics
from tests.integration.servers import serving
from tests.integration.test_distillation_training import NO_EVALUATION, reverse_kls
from tests.integration.test_distributed import assert_close_weights, losses, weights
from tests.integration.test_distributed import train as train_in_processes
from tests.integration.test_trainer import train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory, tiny_model_path):
    """A run folder whose model two quick steps moved away from the tiny model's."""
    run_dir = tmp_path_factory.mktemp("teacher")
    train(run_dir, "training.steps=2", "training.lr=1e-3", *NO_EVALUATION)
    return run_dir


@pytest.mark.parametrize("signal", ["top_k", "sampled"])
def test_a_served_teacher_trains_as_the_loaded_one(tmp_path, teacher_run, signal):
    settings = ["training.steps=2", "training.lr=1e-4", f"distillation.signal={signal}", *NO_EVALUATION]
    train(tmp_path / "loaded", *settings, f"distillation.teacher={teacher_run}")
    with serving(
        "llmrl", "serve-inference", "--model", str(teacher_run), log_path=tmp_path / "teacher.log"
    ) as url:
        train(tmp_path / "served", *settings, f"distillation={{teacher_server: {{url: '{url}'}}}}")
    loaded, served = reverse_kls(tmp_path / "loaded"), reverse_kls(tmp_path / "served")
    assert len(served) == 2 and min(served) > 1e-3  # the teacher differs from the student
    # The first step's rollouts and policy are the same: only float noise tells the teachers apart.
    assert served[0] == pytest.approx(loaded[0], rel=1e-4)
    assert served[1] == pytest.approx(loaded[1], rel=1e-2)
    if signal == "top_k":
        top_k = [reverse_kls(tmp_path / run, "train/teacher_kl") for run in ("loaded", "served")]
        assert top_k[1][0] == pytest.approx(top_k[0][0], rel=1e-4)
    rows = read_metrics(tmp_path / "served" / "metrics.jsonl")
    assert all(row["train/loss"] == row["train/loss"] for row in rows)  # finite, not NaN


def test_two_processes_distill_from_a_served_teacher_like_one(tmp_path, teacher_run):
    with serving(
        "llmrl", "serve-inference", "--model", str(teacher_run), log_path=tmp_path / "teacher.log"
    ) as url:
        for processes in (1, 2):
            train_in_processes(
                tmp_path / str(processes), processes, f"distillation={{teacher_server: {{url: '{url}'}}}}"
            )
    assert losses(tmp_path / "2") == pytest.approx(losses(tmp_path / "1"), rel=1e-5, abs=1e-7)
    top_k = [reverse_kls(tmp_path / str(processes), "train/teacher_kl") for processes in (1, 2)]
    assert top_k[1] == pytest.approx(top_k[0], rel=1e-5, abs=1e-7) and min(top_k[0]) > 1e-3
    assert_close_weights(weights(tmp_path / "2"), weights(tmp_path / "1"))


def test_a_teacher_server_that_is_down_stops_the_run_with_75(tmp_path, capsys, tiny_model_path):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    teacher = f"distillation={{teacher_server: {{url: '{url}', max_retries: 0, request_timeout_s: 5}}}}"
    argv = ["train", "--set", f"run_dir={tmp_path / 'run'}", "--set", teacher, "--set", "training.steps=1"]
    for setting in NO_EVALUATION:
        argv += ["--set", setting]
    assert cli.main(argv) == cli.EXIT_TRY_AGAIN == 75
    error = capsys.readouterr().err
    assert error.startswith(f"llmrl train: stopped: distillation teacher server at {url} not answering (")
    assert error.count("\n") == 1 and error.endswith("rerun the same command to resume\n")
