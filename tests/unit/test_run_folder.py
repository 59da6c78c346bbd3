"""One live run per run folder, and one line when a run folder cannot be written
(llmrl/trainer/run_folder.py, the checkpointer, `llmrl train`)."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from llmrl.cli import EXIT_USAGE, main
from llmrl.config import TrainingConfig, load_config
from llmrl.files import os_error_behind
from llmrl.trainer import checkpoint as ckpt
from llmrl.trainer.checkpointer import checkpointer_for
from llmrl.trainer.optimization import build_optimizer
from llmrl.trainer.policy import PolicyModels
from llmrl.trainer.run_folder import LOCK_FILE, RunFolderWriteError, RunLock
from llmrl.trainer.trainer import _step_schedule

HOLD = (
    "import sys, time\n"
    "from llmrl.trainer.run_folder import RunLock\n"
    "try:\n"
    "    RunLock(sys.argv[1])\n"
    "except ValueError as exc:\n"
    "    print(exc, flush=True)\n"
    "    sys.exit(0)\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)
"""Another process that takes the lock (as a live run does) and keeps it, or prints why it cannot."""


def hold_from_another_process(run_dir: Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    return process, process.stdout.readline().strip()


def refusal_to_another_process(run_dir: Path) -> str:
    """What another process that tries to take the lock is told."""
    process, said = hold_from_another_process(run_dir)
    assert process.wait(timeout=60) == 0, said
    return said


@pytest.fixture
def live_run(tmp_path):
    """A run folder that another live process holds, with an earlier attempt's metrics in it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    process, said = hold_from_another_process(run_dir)
    assert said == "held"
    yield run_dir, process
    process.kill()
    process.wait()


def folder_state(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_run_into_a_live_run_folder_stops_at_once_with_one_line_and_touches_nothing(
    live_run, capsys
):
    run_dir, holder = live_run
    before = folder_state(run_dir)
    code = main(["train", "--set", f"run_dir={run_dir}", "--set", "logging.progress=off"])
    assert code == EXIT_USAGE
    error = capsys.readouterr().err
    pattern = (
        rf"llmrl train: error: run_dir {re.escape(str(run_dir))} is in use by a live run "
        rf"\(pid {holder.pid} on {re.escape(socket.gethostname())}, since \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d"
        r"[+-]\d\d:\d\d\); wait for it to end, stop it, or choose another run_dir\n"
    )
    assert re.fullmatch(pattern, error), error
    # A run starting at step 0 would have cleared the earlier metrics; the live run keeps its lock.
    assert folder_state(run_dir) == before and holder.poll() is None


def test_a_lock_left_by_a_killed_run_is_taken_over(live_run):
    run_dir, holder = live_run
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == holder.pid  # left behind
    lock = RunLock(run_dir)
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run_dir / LOCK_FILE).exists() and (run_dir / "metrics.jsonl").is_file()


def test_a_process_shares_its_hold_and_the_last_release_ends_it(tmp_path):
    run_dir = tmp_path / "runs" / "new"
    first, second = RunLock(run_dir), RunLock(run_dir)  # two Trainers of one folder in one process
    first.release()
    first.release()  # again: nothing
    assert "is in use by a live run" in refusal_to_another_process(run_dir)
    second.release()
    assert not (tmp_path / "runs").exists()  # made for the lock, and nothing else was written there
    RunLock(run_dir).release()  # free to take again


def test_an_unwritable_run_dir_stops_with_one_line_naming_it(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "readonly"
    run_dir.mkdir()
    run_dir.chmod(0o500)  # which root, running the tests, may write anyway: its writes are refused here
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):
        if Path(path).parent == run_dir and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    code = main(["train", "--set", f"run_dir={run_dir}", "--set", "logging.progress=off"])
    assert code == EXIT_USAGE
    assert capsys.readouterr().err == (
        f"llmrl train: error: run_dir: {run_dir} is not writable (Errno 30 read-only file system)\n"
    )


def test_a_plugin_that_raises_on_import_stops_train_with_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("x = 1\n\nfoo()\n")
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--set", "plugins=[my_rewards.py]", "--set", f"run_dir={tmp_path / 'run'}"])
    assert code == EXIT_USAGE
    assert capsys.readouterr().err == (
        "llmrl train: error: plugins: my_rewards.py:3: NameError: name 'foo' is not defined\n"
    )
    assert not (tmp_path / "run").exists()


@pytest.fixture
def checkpointer(tmp_path, tiny_model):
    model, tokenizer = tiny_model
    policy = type(model)(model.config)  # a copy to save, the session's model untouched
    policy.load_state_dict(model.state_dict())
    config = load_config(None, [f"run_dir={tmp_path}", "checkpoint.keep_last=1"])
    models = PolicyModels(
        policy=policy,
        tokenizer=tokenizer,
        compute_dtype=torch.float32,
        adapters=None,
        reference=None,
        reference_context=None,
        tied_names=set(),
    )
    return checkpointer_for(config, models, torch.optim.AdamW(policy.parameters()), None)


def test_a_checkpoint_the_disk_has_no_room_for_stops_with_one_line_and_keeps_the_last_one(
    tmp_path, checkpointer, monkeypatch
):
    checkpointer.save(2, lambda: {"step": 2})
    (tmp_path / "rollout_bank.jsonl").write_text("banked\n")
    real_write_run_state = ckpt.write_run_state

    def disk_full_midway(temp, **kwargs):
        real_write_run_state(temp, **kwargs)  # the weights and the state are written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(temp / "config.yaml"))

    monkeypatch.setattr(ckpt, "write_run_state", disk_full_midway)
    with pytest.raises(RunFolderWriteError) as failure:
        checkpointer.save(4, lambda: {"step": 4})
    assert str(failure.value) == (
        f"cannot write the checkpoint of step 4 into {tmp_path / 'checkpoints'} (Errno 28 no space left on "
        f"device); kept: the checkpoint of step 2 and the rollout bank; once {tmp_path} can be written, the "
        "same command resumes from step 2"
    )
    # keep_last=1 would have pruned step 2 had the new one been taken for written
    assert os.listdir(tmp_path / "checkpoints") == ["step_000002"]
    assert ckpt.load_trainer_state(tmp_path / "checkpoints" / "step_000002")["step"] == 2
    assert (tmp_path / "rollout_bank.jsonl").read_text() == "banked\n"


def test_a_bug_while_saving_keeps_its_traceback_and_leaves_no_partial_folder(
    tmp_path, checkpointer, monkeypatch
):
    def broken(temp, **kwargs):
        (temp / "half").write_text("x")
        raise KeyError("an invariant of ours broke")

    monkeypatch.setattr(ckpt, "write_run_state", broken)
    with pytest.raises(KeyError):
        checkpointer.save(2, lambda: {"step": 2})
    assert os.listdir(tmp_path / "checkpoints") == []


class DiskFull:
    """A file on a disk with room for its first write only."""

    def __init__(self):
        self.writes = 0

    def write(self, data):
        self.writes += 1
        if self.writes > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return len(data)

    def flush(self):
        pass


def test_the_os_error_behind_a_failed_write_is_found_however_the_writer_reported_it():
    with pytest.raises(RuntimeError) as torch_failure:  # torch reports a short write
        torch.save({"weights": torch.zeros(1000)}, DiskFull())
    assert os_error_behind(torch_failure.value).errno == errno.ENOSPC
    safetensors_failure = Exception("Error while serializing: I/O error: Read-only file system (os error 30)")
    assert os_error_behind(safetensors_failure).errno == errno.EROFS
    assert os_error_behind(ValueError("no OS error here")) is None


def test_a_first_step_without_an_update_advances_the_schedule_silently_and_alike():
    training = TrainingConfig(lr=1e-3, warmup_steps=3, steps=10, lr_schedule="linear")
    _, schedule = build_optimizer(torch.nn.Linear(2, 2), training)
    _, reference = build_optimizer(torch.nn.Linear(2, 2), training)
    for _ in range(5):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns when no optimizer step came first
            _step_schedule(schedule)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference.step()
        assert schedule.get_last_lr() == reference.get_last_lr()
