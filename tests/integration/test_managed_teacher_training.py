"""A distillation teacher that the run serves itself (`distillation.teacher_server.serve`): under torchrun
rank 0 starts one server and asks it for every sequence, and two processes train as one."""

from __future__ import annotations

import pytest

from tests.integration.test_distillation_training import reverse_kls
from tests.integration.test_distributed import assert_close_weights, losses, weights
from tests.integration.test_distributed import train as train_in_processes
from tests.integration.test_served_teacher_training import teacher_run  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

STEPS = 2


def test_two_processes_distill_from_a_teacher_they_serve_like_one(tmp_path, teacher_run):  # noqa: F811
    serve = f"distillation={{teacher_server: {{serve: {{model: '{teacher_run}'}}}}}}"
    for processes in (1, 2):
        train_in_processes(tmp_path / str(processes), processes, serve, f"training.steps={STEPS}")
        log = (tmp_path / str(processes) / "teacher_server" / "server.log").read_text()
        assert log.count("==== llmrl: starting") == 1  # one server, whatever the processes
    assert losses(tmp_path / "2") == pytest.approx(losses(tmp_path / "1"), rel=1e-5, abs=1e-7)
    top_k = [reverse_kls(tmp_path / str(processes), "train/teacher_kl") for processes in (1, 2)]
    assert top_k[1] == pytest.approx(top_k[0], rel=1e-5, abs=1e-7) and min(top_k[0]) > 1e-3
    assert_close_weights(weights(tmp_path / "2", STEPS), weights(tmp_path / "1", STEPS))
