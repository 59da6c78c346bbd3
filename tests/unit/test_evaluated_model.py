"""What `llmrl eval` makes of the path or spec it is given, and where the results go (no model loads)."""

import json

import pytest

from llmrl.errors import UserError
from llmrl.trainer import checkpoint as ckpt
from llmrl.trainer.evaluated_model import file_name_part, find_evaluated_model, run_model


def fake_checkpoint(run, step, *, lora):
    """A checkpoint folder with what the resolution reads: trainer state, config, model or adapter."""
    folder = run / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.pt").write_bytes(b"")
    lora_section = "\n  lora: {rank: 8}" if lora else ""
    (folder / "config.yaml").write_text(
        f"model:\n  spec: tiny://arithmetic{lora_section}\nenvironments: [{{agent_type: arithmetic}}]\n"
    )
    if lora:
        (folder / "adapter").mkdir()
        (folder / "adapter" / "adapter_config.json").write_text('{"base_model_name_or_path": "/elsewhere"}')
    else:
        (folder / "model").mkdir()
        (folder / "model" / "config.json").write_text("{}")
    return folder


def test_a_lora_run_checkpoint_or_adapter_folder_is_its_adapter_merged_onto_the_runs_base(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run, 2, lora=True)
    latest = fake_checkpoint(run, 4, lora=True)
    for given, described in [
        (run, "(checkpoint step 4, its latest, LoRA adapter merged onto tiny://arithmetic)"),
        (latest, "(checkpoint step 4, LoRA adapter merged onto tiny://arithmetic)"),
        (latest / "adapter", "(checkpoint step 4, LoRA adapter merged onto tiny://arithmetic)"),
    ]:
        model = find_evaluated_model(str(given))
        assert model.description == f"{given} {described}"
        # The run's config names the base, not the path peft recorded when the adapter was saved.
        assert (model.spec, model.adapter, model.checkpoint) == (
            "tiny://arithmetic",
            latest / "adapter",
            latest,
        )
        assert model.run_config == latest / "config.yaml"
        assert model.results_path(config_run_dir=tmp_path / "other") == run / "eval-step_000004.json"


def test_a_full_checkpoint_or_its_model_folder_is_the_checkpoints_model(tmp_path):
    run = tmp_path / "run"
    checkpoint = fake_checkpoint(run, 3, lora=False)
    for given in (checkpoint, checkpoint / "model"):
        model = find_evaluated_model(str(given))
        assert (model.spec, model.adapter, model.checkpoint) == (str(checkpoint / "model"), None, checkpoint)
        assert model.description == f"{given} (checkpoint step 3)"
        assert model.results_path(config_run_dir=None) == run / "eval-step_000003.json"


def test_a_peft_adapter_of_no_run_is_merged_onto_the_base_its_config_names(tmp_path):
    adapter = tmp_path / "my-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base"}))
    model = find_evaluated_model(str(adapter))
    assert (model.spec, model.adapter, model.checkpoint, model.run_dir) == ("org/base", adapter, None, None)
    assert model.description == f"{adapter} (LoRA adapter merged onto org/base)"
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(UserError, match="names no base model"):
        find_evaluated_model(str(adapter))


def test_models_of_no_run_land_in_the_configs_run_or_the_current_folder_under_their_own_names(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    for name in ("exports/a", "exports/b"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "config.json").write_text("{}")
    first, second = find_evaluated_model("exports/a"), find_evaluated_model(str(tmp_path / "exports/b"))
    assert first.description == "exports/a (Hugging Face model folder)"
    assert first.results_path(config_run_dir=None).as_posix() == "eval-exports-a.json"
    assert second.results_path(config_run_dir=None).as_posix() == "eval-exports-b.json"
    assert first.results_path(config_run_dir="runs/x").as_posix() == "runs/x/eval-exports-a.json"
    spec = find_evaluated_model("tiny://arithmetic")
    assert (spec.spec, spec.run_dir) == ("tiny://arithmetic", None)
    assert spec.results_path(config_run_dir=None).as_posix() == "eval-tiny-arithmetic.json"


def test_a_folder_name_outside_the_current_folder_keeps_its_whole_path(tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    (tmp_path / "hf").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert file_name_part("../hf") == file_name_part(str(tmp_path / "hf")) != file_name_part("hf")
    assert file_name_part("Qwen/Qwen2.5-1.5B") == "Qwen-Qwen2.5-1.5B"
    assert file_name_part("/".join(["x" * 60] * 4)) == "-".join(["x" * 60] * 4)[-120:]


def test_a_runs_config_stands_for_its_latest_checkpoint_else_its_untrained_spec(tmp_path):
    run = tmp_path / "run"
    untrained = run_model(run, "tiny://arithmetic")
    assert untrained.description == f"the untrained model.spec tiny://arithmetic ({run} has no checkpoint)"
    assert untrained.results_path(config_run_dir=run) == run / "eval-tiny-arithmetic.json"
    latest = fake_checkpoint(run, 7, lora=False)
    trained = run_model(run, "tiny://arithmetic")
    assert trained.description == (
        f"{run}'s trained weights (checkpoint step 7, its latest, not the untrained model.spec tiny://arithmetic)"
    )
    assert (trained.spec, trained.checkpoint) == (str(latest / "model"), latest)
    assert trained.results_path(config_run_dir=run) == run / "eval-step_000007.json"


def test_folders_that_hold_no_model_are_refused_with_what_was_expected(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(UserError, match="run folder has no checkpoint yet"):
        find_evaluated_model(str(run))
    with pytest.raises(UserError, match="not a run or checkpoint folder, a LoRA adapter folder"):
        find_evaluated_model(str(tmp_path))


def test_a_torn_checkpoint_is_passed_over_in_its_run_and_refused_by_name(tmp_path):
    run = tmp_path / "run"
    previous = fake_checkpoint(run, 2, lora=False)
    newest = fake_checkpoint(run, 4, lora=False)
    for folder in (previous, newest):
        ckpt.write_manifest(folder)
    (newest / "config.yaml").write_text("seed: 1\n")  # another size than its manifest says
    for named in (newest, newest / "model"):
        with pytest.raises(UserError, match=r"step_000004 is torn \(config.yaml has [\d,]+ bytes"):
            find_evaluated_model(str(named))
    assert newest.is_dir()  # named, so left where it is
    model = find_evaluated_model(str(run))
    assert (model.checkpoint, model.description) == (previous, f"{run} (checkpoint step 2, its latest)")
    assert not newest.exists() and (run / "checkpoints" / "step_000004.torn").is_dir()
