"""A model server that llmrl starts and owns (`llmrl.inference.managed_server`): it answers, leaves no
process behind, and one that cannot start fails fast with its log's last lines; a served distillation
teacher named by `url` or by `serve`, and started by the trainer; the check that a served teacher
tokenizes as the policy does, through `POST /tokenize` (llmrl's server answers it as vLLM's does)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from llmrl.config import ConfigError, ServeConfig, load_config
from llmrl.inference.engine import LocalEngine
from llmrl.inference.managed_server import ManagedModelServer, ModelServerStartError, start_model_server
from llmrl.inference.served_teacher import (
    ServedTeacher,
    TeacherServerError,
    TokenizerCheck,
    check_served_tokenizer,
)
from llmrl.server.inference_server import create_inference_app
from llmrl.telemetry import read_metrics

FIELD = "distillation.teacher_server.serve"


def test_an_llmrl_server_answers_a_chat_completion_and_leaves_no_process(tmp_path):
    server = start_model_server(
        ServeConfig(model="tiny://arithmetic"), log_path=tmp_path / "server.log", seed=0
    )
    pid = server.process.pid if server.process is not None else None
    try:
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 4}
        answer = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"]
    finally:
        server.close()
    assert pid is not None and not Path(f"/proc/{pid}").exists()
    assert "serve-inference --model tiny://arithmetic" in (tmp_path / "server.log").read_text()


def test_a_server_that_cannot_start_fails_fast_naming_model_port_and_log(tmp_path):
    log_path = tmp_path / "server.log"
    started = time.monotonic()
    with pytest.raises(ModelServerStartError) as failed:
        start_model_server(ServeConfig(model="tiny://nothing"), log_path=log_path, seed=0, field=FIELD)
    assert time.monotonic() - started < 60
    first, *tail = str(failed.value).splitlines()
    assert first.startswith(f"the llmrl server of {FIELD}.model=tiny://nothing on port ")
    assert first.endswith(f"exited while starting (log: {log_path}); its last lines:")
    assert any("unknown model spec 'tiny://nothing'" in line for line in tail)


def test_a_vllm_server_gets_a_teachers_flags_and_none_of_trainings(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMRL_VLLM_PYTHON", sys.executable)
    config = ServeConfig(
        model="Org/teacher", engine="vllm", dtype="bfloat16", extra_args=["--max-model-len", "512"]
    )
    server = ManagedModelServer(
        config, log_path=tmp_path / "server.log", seed=3, field=FIELD, max_logprobs=64
    )
    command = " ".join(server.command())
    assert command.startswith(f"{sys.executable} -m vllm.entrypoints.openai.api_server --model Org/teacher ")
    assert " --dtype bfloat16 --seed 3 --host 127.0.0.1 " in command and " --max-logprobs 64" in command
    assert command.endswith("--max-model-len 512")
    assert "--worker-extension-cls" not in command and "--weight-transfer-config" not in command
    assert server.health_route == "/health" and server.base_url.endswith("/v1")
    server.close()


@pytest.mark.parametrize(
    "teacher_server",
    ["{}", "{url: 'http://127.0.0.1:8100/v1', serve: {model: 'tiny://arithmetic'}}"],
    ids=["neither", "both"],
)
def test_a_teacher_server_is_named_by_url_or_by_serve(teacher_server):
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"distillation={{teacher_server: {teacher_server}}}"])
    message = str(refused.value)
    assert message.startswith("distillation.teacher_server: name one teacher server: `url`")
    assert "`serve`" in message and "\n" not in message
    served = load_config(None, ["distillation={teacher_server: {serve: {model: 'tiny://arithmetic'}}}"])
    assert served.distillation.teacher_server.serve == ServeConfig(model="tiny://arithmetic")


@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    """llmrl's app serving the tiny model, in process."""
    model, tokenizer = tiny_model
    return create_inference_app(LocalEngine(model, tokenizer), model_name="teacher")


def served_teacher(app) -> ServedTeacher:
    return ServedTeacher("http://teacher", transport=httpx.ASGITransport(app))


def swapped_tokenizer_folder(tiny_model_path: Path, folder: Path) -> Path:
    """The tiny model with a tokenizer of another vocabulary: the ids of '1' and '2' swapped."""
    shutil.copytree(tiny_model_path, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def test_the_tokenize_route_answers_as_vllms_and_refuses_malformed_bodies(tiny_server, tiny_model):
    _, tokenizer = tiny_model
    client = TestClient(tiny_server)
    answer = client.post("/tokenize", json={"prompt": "12+3=", "return_token_strs": True})
    assert answer.status_code == 200
    assert answer.json() == {
        "count": 5,
        "max_model_len": 1024,
        "tokens": tokenizer("12+3=")["input_ids"],
        "token_strs": ["1", "2", "+", "3", "="],
    }
    for body in ({"prompt": 12}, {"text": "12"}, {"prompt": "1", "add_special_tokens": "yes"}):
        refused = client.post("/tokenize", json=body)
        assert 400 <= refused.status_code < 500, body
    not_json = client.post("/tokenize", content=b"{", headers={"content-type": "application/json"})
    assert 400 <= not_json.status_code < 500


def test_a_served_teacher_with_the_policys_tokenizer_passes(tiny_server, tiny_model):
    _, tokenizer = tiny_model
    assert served_teacher(tiny_server).tokenizer_check(tokenizer) == TokenizerCheck()


def test_a_served_teacher_with_another_tokenizer_is_refused_in_one_line(
    tiny_server, tiny_model_path, tmp_path
):
    policy = AutoTokenizer.from_pretrained(swapped_tokenizer_folder(tiny_model_path, tmp_path / "policy"))
    with pytest.raises(TeacherServerError) as refused:
        check_served_tokenizer(
            served_teacher(tiny_server), policy, teacher="tiny://arithmetic", policy="POLICY"
        )
    assert str(refused.value) == (
        "distillation.teacher_server: the tokenizer of the teacher tiny://arithmetic is not that of model.spec "
        "POLICY (token 11 of a probe text is 19 '1' in the teacher, 20 '1' in the policy); a teacher must "
        "score the very tokens the policy samples"
    )


def test_a_server_without_a_tokenize_route_is_not_checked_with_a_warning(tiny_model, caplog):
    _, tokenizer = tiny_model
    server = ServedTeacher(
        "http://teacher/v1", transport=httpx.MockTransport(lambda request: httpx.Response(404)), max_retries=0
    )
    assert server.tokenizer_check(tokenizer).unchecked == "http://teacher/tokenize is not found"
    with caplog.at_level(logging.WARNING, logger="llmrl"):
        check_served_tokenizer(server, tokenizer, teacher="T", policy="P")
    (warning,) = caplog.messages
    assert warning.startswith(
        "distillation.teacher_server: the tokenizer of the teacher T could not be checked"
    )


def test_a_run_distills_from_a_teacher_it_serves_and_stops_it(tmp_path):
    from llmrl.trainer import Trainer

    overrides = [
        f"run_dir={tmp_path / 'run'}",
        "training.steps=2",
        "training.prompts_per_step=4",
        "training.group_size=4",
        "evaluation.at_start=false",
        "evaluation.at_end=false",
        "logging.tensorboard=false",
        "logging.progress=plain",
        "distillation={teacher_server: {serve: {model: 'tiny://arithmetic'}}, top_k: 8}",
    ]
    trainer = Trainer(load_config(None, overrides), progress_stream=open(os.devnull, "w"))  # noqa: SIM115
    server = trainer.teacher_server
    assert server is not None and server.alive()
    pid = server.process.pid if server.process is not None else None
    trainer.run()
    assert not server.alive() and pid is not None and not Path(f"/proc/{pid}").exists()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # The teacher is the student's start: the first step's KL to it is 0 but for float rounding.
    assert len(rows) == 2 and rows[0]["train/teacher_kl"] == pytest.approx(0.0, abs=1e-5)
    assert (tmp_path / "run" / "teacher_server" / "server.log").is_file()


def test_a_run_refuses_a_served_teacher_of_another_tokenizer(tmp_path, tiny_model_path):
    from llmrl.trainer import Trainer

    teacher = swapped_tokenizer_folder(tiny_model_path, tmp_path / "teacher")
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        f"distillation={{teacher_server: {{serve: {{model: '{teacher}'}}}}}}",
    ]
    with pytest.raises(
        TeacherServerError, match=r"token 11 of a probe text is 20 '1' in the teacher, 19 '1'"
    ):
        Trainer(load_config(None, overrides), progress_stream=open(os.devnull, "w"))  # noqa: SIM115
    assert "serve-inference --model" in (tmp_path / "run" / "teacher_server" / "server.log").read_text()
