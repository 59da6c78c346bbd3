"""`llmrl train` and its run folder end to end on the tiny model: a second run into a live run's folder,
a full disk at a checkpoint, a finished run asked for fewer steps (llmrl/trainer/run_folder.py)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llmrl.cli import EXIT_FAILED, EXIT_USAGE, main
from llmrl.telemetry import read_metrics
from llmrl.trainer import checkpoint as ckpt
from llmrl.trainer.run_folder import LOCK_FILE
from tests.integration.test_trainer import QUICK, final_weights

pytestmark = pytest.mark.slow


def sets(run_dir: Path, *overrides: str) -> list[str]:
    options = [f"run_dir={run_dir}", *QUICK, "evaluation.at_start=false", *overrides]
    return [a for o in options for a in ("--set", o)]


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [row["step"] for row in read_metrics(path)] if path.exists() else []


def test_a_second_run_into_a_live_run_folder_is_refused_and_the_first_goes_on(tmp_path, tiny_model_path):
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "llmrl",
        "train",
        *sets(run_dir, "training.steps=1000", "checkpoint.every=0", "logging.tensorboard=true"),
    ]
    first = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not logged_steps(run_dir):
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)

    second = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert second.returncode == EXIT_USAGE, second.stderr
    assert second.stderr.startswith(
        f"llmrl train: error: run_dir {run_dir} is in use by a live run (pid {first.pid} "
    )
    assert second.stderr.count("\n") == 1 and "resuming" not in second.stdout

    refused_at = len(logged_steps(run_dir))
    while len(logged_steps(run_dir)) <= refused_at:  # the first run trains on
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 130, stderr
    steps = logged_steps(run_dir)
    assert steps == list(range(1, len(steps) + 1))  # one run's steps, each once
    assert len(list((run_dir / "tensorboard").glob("events.*"))) == 1
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.cross_cpu
def test_a_full_disk_at_a_checkpoint_stops_with_one_line_and_the_same_command_resumes_exactly(
    tmp_path, tiny_model_path, capsys, monkeypatch
):
    overrides = [
        "training.steps=4",
        "checkpoint.every=2",
        "checkpoint.keep_last=1",
        "evaluation.at_end=false",
        "evaluation.every=0",
        "training.lr=1e-4",
        "training.generation_lag=1",
    ]
    assert main(["train", *sets(tmp_path / "whole", *overrides)]) == 0

    run_dir = tmp_path / "run"
    real_write_run_state = ckpt.write_run_state
    bank_at_failure = []

    def disk_full_at_step_4(temp, *, trainer_state, config_yaml):
        real_write_run_state(temp, trainer_state=trainer_state, config_yaml=config_yaml)
        if trainer_state["step"] == 4:  # the weights and the state are written, then the disk is full
            bank_at_failure.append((run_dir / "rollout_bank.jsonl").read_bytes())
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(temp / "config.yaml"))

    monkeypatch.setattr(ckpt, "write_run_state", disk_full_at_step_4)
    capsys.readouterr()
    assert main(["train", *sets(run_dir, *overrides)]) == EXIT_FAILED
    assert capsys.readouterr().err == (
        f"llmrl train: error: cannot write the checkpoint of step 4 into {run_dir / 'checkpoints'} (Errno 28 "
        f"no space left on device); kept: the checkpoint of step 2 and the rollout bank; once {run_dir} can "
        "be written, the same command resumes from step 2\n"
    )
    assert os.listdir(run_dir / "checkpoints") == [
        "step_000002"
    ]  # keep_last=1 pruned nothing, no partial folder
    assert (run_dir / "rollout_bank.jsonl").read_bytes() == bank_at_failure[0] != b""
    assert not (run_dir / LOCK_FILE).exists()

    monkeypatch.undo()
    assert main(["train", *sets(run_dir, *overrides)]) == 0
    output = capsys.readouterr().out
    assert f"resuming {run_dir} from its checkpoint at step 2" in output
    assert "training first on 2 batch(es) generated before the interruption" in output
    expected, actual = final_weights(tmp_path / "whole"), final_weights(run_dir)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_a_run_asked_for_fewer_steps_than_it_ran_says_so_and_leaves_its_folder_alone(
    tmp_path, tiny_model_path, capsys
):
    run_dir = tmp_path / "run"
    assert main(["train", *sets(run_dir, "training.steps=3")]) == 0
    before = {
        path: (path.read_bytes(), path.stat().st_mtime_ns) for path in run_dir.rglob("*") if path.is_file()
    }
    capsys.readouterr()
    assert main(["train", *sets(run_dir, "training.steps=2")]) == 0
    assert capsys.readouterr() == (
        f"{run_dir} already ran 3 steps (training.steps=2): nothing to train; raise training.steps to continue\n",
        "",
    )
    after = {
        path: (path.read_bytes(), path.stat().st_mtime_ns) for path in run_dir.rglob("*") if path.is_file()
    }
    assert after == before
