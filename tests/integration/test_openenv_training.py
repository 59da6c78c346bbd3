"""Runs of the trainer against an OpenEnv environment: the tiny model plays examples/openenv_sums.py (served
by llmrl from the plug-in, in its own process, or reached at a URL), the environment's step rewards are the
rewards, and the held-out seeds are evaluated at the end. A server that dies mid-run stops the run with
exit status 75, and the same command resumes it once the server is back, to the numbers of a run during
which it never died."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmrl import cli, registry
from llmrl.config import config_from_dict
from llmrl.processes import free_port
from llmrl.rollouts import RolloutBank
from llmrl.telemetry import read_metrics
from tests.integration.short_runs import failures, short_run, train

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "openenv_sums.py"


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


# examples/openenv_sums.py's environment, on a server whose resets past the first RESETS_BEFORE_STALL (when
# set) never answer: each marks STALL_MARKER and waits. The test kills the server there, at a known point
# of the run (the batch of step 3), rather than racing the run with a timer.
STALLING_SERVER = """
    import itertools
    import os
    import time
    from pathlib import Path

    from openenv.core.env_server import create_app
    from openenv_sums import SumAction, SumObservation, SumsEnvironment

    resets = itertools.count(1)


    class StallingSums(SumsEnvironment):
        def reset(self, seed=None, episode_id=None, **kwargs):
            limit = os.environ.get("RESETS_BEFORE_STALL")
            if limit is not None and next(resets) > int(limit):
                Path(os.environ["STALL_MARKER"]).touch()
                time.sleep(600)
            return super().reset(seed, episode_id, **kwargs)


    app = create_app(StallingSums, SumAction, SumObservation, env_name="sums", max_concurrent_envs=64)
"""


def start_server(folder: Path, port: int, **env: str) -> subprocess.Popen:
    """The stalling server under uvicorn on `port`, once it answers."""
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "stalling_sums:app", "--port", str(port), "--log-level", "warning"],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(EXAMPLES)]), **env},
    )
    deadline = time.monotonic() + 60
    while True:
        assert server.poll() is None and time.monotonic() < deadline, "the environment server did not start"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.1)


def test_a_dead_environment_server_stops_the_run_with_75_and_the_same_command_resumes(
    tmp_path, tiny_model_path, plugins, capsys
):
    (tmp_path / "stalling_sums.py").write_text(textwrap.dedent(STALLING_SERVER))
    port, run_dir, marker = free_port(), tmp_path / "run", tmp_path / "stalled"
    url = f"http://127.0.0.1:{port}"
    config = {
        "run_dir": str(run_dir),
        "model": {"spec": "tiny://arithmetic"},
        "plugins": [str(EXAMPLE)],
        "environments": [
            {
                "agent_type": "openenv",
                "env_id": "sums",
                "agent_args": {
                    "url": url,
                    "observation_to_messages": "openenv_sums:observation_to_messages",
                    "completion_to_action": "openenv_sums:completion_to_action",
                    "max_turns": 2,
                    "max_sessions": 16,
                    "num_problems": 64,
                    "eval_size": 8,
                },
            }
        ],
        "inference": {"max_concurrent": 64, "generation": {"max_tokens": 8}},
        "training": {"steps": 3, "prompts_per_step": 4, "group_size": 4, "lr": 3e-4},
        "evaluation": {"every": 0, "at_start": False, "num_prompts": 4, "samples_per_prompt": 2, "ks": [1]},
        "checkpoint": {"every": 1},
        "logging": {"progress": "off", "tensorboard": False, "trace": False},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "llmrl", "train", str(tmp_path / "config.yaml")]

    # Steps 1 and 2 reset 2 x 4 x 4 sessions; the server stalls on the resets of step 3's batch.
    server = start_server(tmp_path, port, RESETS_BEFORE_STALL=str(2 * 4 * 4), STALL_MARKER=str(marker))
    run = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.05)
        server.kill()
        server.wait()
        _, stderr = run.communicate(timeout=120)
    finally:
        run.kill()
        server.kill()
    assert run.returncode == 75, stderr
    stop_line = stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"llmrl train: stopped: sums: openenv server {url} unreachable since "
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d: \S.* \(batch of step 3: 16 of 16 rollouts could not reach it\); "
        r"nothing from it was trained on or kept; rerun the same command to resume",
        stop_line,
    ), stop_line
    assert "Traceback" not in stderr
    # Nothing of step 3 was kept: the checkpoint of step 2 is the run's last, and the bank is empty.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    assert RolloutBank(run_dir).read() == []

    server = start_server(tmp_path, port)  # back, on the same URL, and answering every reset
    try:
        # The same command again, in this process (a second interpreter would only add its start-up).
        assert cli.main(command[3:]) == 0
        # The run as it would have gone without the server's death.
        whole_summary, whole_rows = train(config_from_dict({**config, "run_dir": str(tmp_path / "whole")}))
    finally:
        server.kill()
    assert f"resuming {run_dir} from its checkpoint at step 2" in capsys.readouterr().out
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]  # each step trained and logged once
    assert not any(failures(row, "sums") for row in rows)
    assert [row["train/loss"] for row in rows] == [row["train/loss"] for row in whole_rows]
    assert json.loads((run_dir / "summary.json").read_text())["eval_end"] == whole_summary["eval_end"]
    expected, actual = (
        load_file(folder / "checkpoints" / "step_000003" / "model" / "model.safetensors")
        for folder in (tmp_path / "whole", run_dir)
    )
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
