"""Paths are paths, hub ids are hub ids, and a run's folders stand for its models wherever a model is
taken (llmrl/models/loading.py, llmrl/trainer/evaluated_model.py, docs/models.md)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from huggingface_hub import constants
from huggingface_hub.errors import RepositoryNotFoundError
from huggingface_hub.utils import httpx as hub_httpx  # the HTTP client huggingface_hub's errors carry

from llmrl import cli
from llmrl.cli import main
from llmrl.config import ConfigError, load_config
from llmrl.config import loading as config_loading
from llmrl.config.loading import EXAMPLES
from llmrl.errors import ModelSpecError
from llmrl.models import load_model, loading
from llmrl.server import inference_server
from llmrl.trainer import checkpoint as ckpt
from llmrl.trainer.evaluated_model import file_name_part, find_evaluated_model, with_model_folder
from llmrl.trainer.policy import plan_training_memory

RUN_CONFIG = "model:\n  spec: tiny://arithmetic\nenvironments: [{agent_type: arithmetic}]\n"
OFFLINE = "its tokenizer is not in the local cache, and the hub is not asked (HF_HUB_OFFLINE is set)"


def trained_run(run_dir, tiny_model, steps=(1, 2)):
    """A run folder with a full (not LoRA) checkpoint per step; returns the latest checkpoint's folder."""
    model, tokenizer = tiny_model
    for step in steps:
        folder = ckpt.save_checkpoint(
            run_dir,
            step,
            model=model,
            tokenizer=tokenizer,
            trainer_state={"step": step},
            config_yaml=RUN_CONFIG,
            keep_last=len(steps),
        )
    return folder


def spec_error(spec: str) -> str:
    with pytest.raises(ModelSpecError) as failure:
        load_model(spec, device="meta")
    message = str(failure.value)
    assert "\n" not in message
    return message


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working folder of its own, with no run folders in it; no config loaded before named a spec."""
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setattr(config_loading, "_CONFIG_FOLDERS_OF_MISSING_SPECS", {})
    return folder


def test_a_spec_that_starts_like_a_path_is_a_missing_folder_never_a_hub_id(elsewhere, monkeypatch):
    monkeypatch.setattr(loading, "_unreachable_hub", lambda: pytest.fail("a path was sent to the hub"))
    assert spec_error("./runs/mine") == (
        f"model spec './runs/mine': no folder ./runs/mine (looked in the working folder: {elsewhere}/runs/mine)"
    )
    assert spec_error("/no/such/model") == "model spec '/no/such/model': no folder /no/such/model"


def test_a_home_path_is_expanded(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert spec_error("~/models/gone") == (
        f"model spec '~/models/gone': no folder ~/models/gone (looked in {tmp_path}/models/gone)"
    )
    latest = trained_run(tmp_path / "runs" / "teacher", tiny_model)
    first = latest.with_name("step_000001")
    config = load_config(None, ["distillation={teacher: '~/runs/teacher/checkpoints/step_000001'}"])
    assert find_evaluated_model(config.distillation.teacher).spec == str(first / "model")
    assert plan_training_memory(config, "cpu", None).terms(rank0=True)["teacher"] > 0
    starting = with_model_folder(load_config(None, ["model.spec=~/runs/teacher"]))
    assert starting.model.spec == str(latest / "model")


def test_a_missing_run_folder_says_where_it_looked_what_the_hub_said_and_what_makes_it(elsewhere):
    assert spec_error("runs/demo") == (
        f"model spec 'runs/demo': no folder runs/demo (looked in the working folder: {elsewhere}/runs/demo); "
        f"{OFFLINE}; run `llmrl train` first"
    )
    example = EXAMPLES / "arithmetic_lora.yaml"
    assert spec_error("runs/arithmetic_lora").endswith(f"{OFFLINE}; run `llmrl train {example}` first")
    assert spec_error("runs/demo/checkpoints/step_000020") == (
        "model spec 'runs/demo/checkpoints/step_000020': no folder runs/demo/checkpoints/step_000020 (looked "
        f"in the working folder: {elsewhere}/runs/demo/checkpoints/step_000020), and it is not a Hugging Face "
        "hub id (owner/name); run `llmrl train` first"
    )
    assert spec_error("someone/model").endswith(OFFLINE)  # no run of llmrl makes it


def test_a_teacher_named_by_a_config_elsewhere_was_looked_for_in_both_folders(tmp_path, elsewhere):
    config_folder = tmp_path / "configs"
    config_folder.mkdir()
    (config_folder / "distill.yaml").write_text(RUN_CONFIG + "distillation: {teacher: runs/demo}\n")
    config = load_config(config_folder / "distill.yaml")
    with pytest.raises(ConfigError) as failure:
        plan_training_memory(config, "cpu", None)
    assert str(failure.value) == (
        "distillation.teacher: model spec 'runs/demo': no folder runs/demo (looked in the working folder "
        f"and beside the config: {elsewhere}/runs/demo, {config_folder}/runs/demo); {OFFLINE}; "
        "run `llmrl train` first"
    )


def test_the_hub_answer_is_told_beside_the_missing_folder(elsewhere, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(loading, "_unreachable_hub", lambda: None)

    def no_such_repository(source, **options):
        answer = hub_httpx.Response(404, request=hub_httpx.Request("GET", f"https://hub.example/{source}"))
        raise OSError(f"{source} is not a local folder and is not a valid model identifier") from (
            RepositoryNotFoundError(f"404 {source}", response=answer)
        )

    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", no_such_repository)
    assert spec_error("runs/demo") == (
        f"model spec 'runs/demo': no folder runs/demo (looked in the working folder: {elsewhere}/runs/demo); "
        "the hub has no model runs/demo; run `llmrl train` first"
    )
    monkeypatch.setattr(loading, "_unreachable_hub", lambda: "https://hub.example cannot be reached: refused")
    assert (
        "; its tokenizer is not in the local cache, and https://hub.example cannot be reached: refused; "
        in (spec_error("runs/demo"))
    )


def test_a_run_folder_as_model_spec_is_its_latest_checkpoints_model(tmp_path, elsewhere, tiny_model):
    latest = trained_run(elsewhere / "runs" / "base", tiny_model)
    config = with_model_folder(load_config(None, ["model.spec=runs/base", f"run_dir={tmp_path / 'next'}"]))
    assert config.model.spec == str(latest.relative_to(elsewhere) / "model")  # relative as model.spec was
    assert plan_training_memory(config, "cpu", None).total() > 0
    unchanged = load_config(None, [])
    assert with_model_folder(unchanged) == unchanged


def test_a_run_folder_without_a_checkpoint_as_model_spec_says_what_makes_it(elsewhere):
    (elsewhere / "runs" / "demo").mkdir(parents=True)
    (elsewhere / "runs" / "demo" / "config.yaml").write_text(RUN_CONFIG)
    with pytest.raises(ConfigError) as failure:
        with_model_folder(load_config(None, ["model.spec=runs/demo"]))
    assert str(failure.value) == (
        "model.spec: runs/demo: this run folder has no checkpoint yet; run `llmrl train` first"
    )


def lora_checkpoint(run_dir, tiny_model):
    """A LoRA run's checkpoint whose adapter changes the tiny model (its B matrices are not zero)."""
    import copy

    import peft
    import torch

    model, _ = tiny_model
    torch.manual_seed(0)
    adapted = peft.get_peft_model(
        copy.deepcopy(model),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    written = ckpt.start_checkpoint(run_dir, 1)
    adapted.save_pretrained(written / "adapter")
    lora_config = RUN_CONFIG.replace("arithmetic\n", "arithmetic\n  lora: {rank: 4}\n", 1)
    ckpt.write_run_state(written, trainer_state={}, config_yaml=lora_config)
    return ckpt.finish_checkpoint(run_dir, 1, written, keep_last=1)


def test_a_lora_checkpoint_as_model_spec_is_refused_where_nothing_trains(tmp_path, tiny_model):
    checkpoint = lora_checkpoint(tmp_path / "lora", tiny_model)
    with pytest.raises(ConfigError) as failure:
        with_model_folder(load_config(None, [f"model.spec={checkpoint}"]))
    assert str(failure.value) == (
        f"model.spec: {checkpoint} holds a LoRA adapter, not a whole model: write it merged onto its base "
        f"(tiny://arithmetic) with `llmrl export {checkpoint} FOLDER` and set model.spec to FOLDER"
    )


def test_a_run_starting_from_a_lora_run_merges_it_into_its_own_folder_once(tmp_path, tiny_model):
    import torch

    lora_run = tmp_path / "lora"
    checkpoint = lora_checkpoint(lora_run, tiny_model)
    overrides = ["model.spec=" + str(lora_run), f"run_dir={tmp_path / 'next'}"]
    config = with_model_folder(load_config(None, overrides), merge_lora=True)
    merged = tmp_path / "next" / "start_models" / file_name_part(str(checkpoint))
    assert config.model.spec == str(merged)
    written = (merged / "model.safetensors").stat().st_mtime_ns
    assert (
        with_model_folder(load_config(None, overrides), merge_lora=True) == config
    )  # kept, not merged again
    assert (merged / "model.safetensors").stat().st_mtime_ns == written
    assert not [p for p in merged.parent.iterdir() if p.name.startswith(".merging-")]
    model, _ = load_model(config.model.spec)
    base = tiny_model[0].state_dict()
    changed = [name for name, value in model.state_dict().items() if not torch.equal(value, base[name])]
    assert changed and all("q_proj" in name or "v_proj" in name for name in changed)


def test_serve_inference_serves_a_run_folders_latest_checkpoint(tmp_path, tiny_model, monkeypatch, capsys):
    trained_run(tmp_path / "run", tiny_model)
    served = []
    monkeypatch.setattr(inference_server, "run_server", lambda app, host, port: served.append(app))
    monkeypatch.setattr(cli, "_server_logging", lambda: None)  # the process's logging stays pytest's
    assert main(["serve-inference", "--model", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out == f"serving {tmp_path / 'run'} (checkpoint step 2, its latest)\n"
    with TestClient(served[0]) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == str(tmp_path / "run")
        answer = client.post("/v1/completions", json={"prompt": "2 + 3 =", "max_tokens": 2})
        assert answer.status_code == 200 and len(answer.json()["choices"][0]["token_ids"]) == 2


def test_serve_env_takes_a_run_folder_as_model_spec(tmp_path, tiny_model, monkeypatch):
    from llmrl.server import env_server

    latest = trained_run(tmp_path / "run", tiny_model)
    config_file = tmp_path / "env.yaml"
    config_file.write_text(RUN_CONFIG.replace("tiny://arithmetic", str(tmp_path / "run")))
    served = []
    monkeypatch.setattr(env_server, "run_server", lambda app, host, port: served.append(app))
    monkeypatch.setattr(env_server, "create_env_app", lambda config, **options: config)
    monkeypatch.setattr(cli, "_server_logging", lambda: None)
    assert main(["serve-env", str(config_file)]) == 0
    (config,) = served
    assert config.model.spec == str(latest / "model")
