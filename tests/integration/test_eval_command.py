"""`llmrl eval` on what runs of the tiny model produced: full and LoRA runs, their checkpoints and
adapter, an export; what it says it evaluates and where its results land."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from llmrl.cli import main
from llmrl.config import load_config
from llmrl.models import load_model
from llmrl.trainer import Trainer
from llmrl.trainer.evaluated_model import find_evaluated_model

pytestmark = pytest.mark.slow

QUICK = [
    "training.prompts_per_step=4",
    "training.group_size=4",
    "training.lr_schedule=constant",
    "evaluation.at_start=false",
    "evaluation.at_end=false",
    "logging.progress=off",
    "logging.tensorboard=false",
]
SMALL_EVAL = [
    "--set",
    "evaluation.num_prompts=4",
    "--set",
    "evaluation.samples_per_prompt=2",
    "--set",
    "evaluation.ks=[1, 2]",
]


def train(run_dir: Path, *overrides: str) -> Path:
    config = load_config(None, [f"run_dir={run_dir}", *QUICK, *overrides])
    Trainer(config, progress_stream=open(os.devnull, "w")).run()  # noqa: SIM115
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A LoRA run (one step at a learning rate that moves the adapter) and a full run with two
    checkpoints, each with the eval.json an earlier `llmrl eval` wrote."""
    root = tmp_path_factory.mktemp("runs")
    made = {
        "lora": train(
            root / "lora", "training.steps=1", "model.lora={rank: 8, alpha: 16}", "training.lr=3e-2"
        ),
        "full": train(root / "full", "training.steps=2", "checkpoint.every=1"),
    }
    for run in made.values():
        (run / "eval.json").write_text('{"earlier": true}\n')
    return made


def evaluate(capsys, *argv: str) -> tuple[str, Path, dict]:
    """Run `llmrl eval`; its first line, the file it wrote and that file's content."""
    assert main(["eval", *argv, *SMALL_EVAL]) == 0
    lines = capsys.readouterr().out.splitlines()
    written = Path(lines[-1].removeprefix("wrote "))
    return lines[0], written, json.loads(written.read_text())


def files(folder: Path) -> set[Path]:
    return {path for path in folder.rglob("*") if path.is_file()}


def test_a_lora_run_checkpoint_or_adapter_is_evaluated_merged_onto_its_base(runs, capsys):
    run = runs["lora"]
    checkpoint = run / "checkpoints" / "step_000001"
    for given, described in [
        (run, f"{run} (checkpoint step 1, its latest, LoRA adapter merged onto tiny://arithmetic)"),
        (checkpoint, f"{checkpoint} (checkpoint step 1, LoRA adapter merged onto tiny://arithmetic)"),
        (checkpoint / "adapter", f"{checkpoint / 'adapter'} (checkpoint step 1, LoRA adapter merged onto "),
    ]:
        line, written, report = evaluate(capsys, "--model", str(given))
        assert line.startswith(f"evaluating {described}")
        assert line.endswith("on arithmetic: the first 4 held-out problems")
        assert written == run / "eval-step_000001.json"
        assert report["checkpoint"] == str(checkpoint) and report["evaluation"]["arithmetic"]["problems"] == 4
    assert json.loads((run / "eval.json").read_text()) == {"earlier": True}


def test_the_served_model_is_the_base_with_the_adapter_merged(runs):
    from peft import PeftModel

    model = find_evaluated_model(str(runs["lora"]))
    settings = load_config(model.run_config).model
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad(), model.served(settings) as served:
        assert served.lora is None
        logits = load_model(served.spec)[0](input_ids=ids).logits
        base = load_model("tiny://arithmetic")[0]
        base_logits = base(input_ids=ids).logits
        expected = PeftModel.from_pretrained(base, str(model.adapter))(input_ids=ids).logits
    assert torch.allclose(logits, expected, atol=1e-4)
    assert not torch.allclose(logits, base_logits, atol=1e-3)  # the adapter changed the model
    assert not Path(served.spec).exists()  # the merged folder was temporary


def test_a_runs_config_evaluates_its_latest_checkpoint_into_its_own_folder(runs, capsys):
    run = runs["full"]
    line, written, report = evaluate(capsys, str(run / "config.yaml"))
    assert line.startswith(
        f"evaluating {run}'s trained weights (checkpoint step 2, its latest, "
        "not the untrained model.spec tiny://arithmetic) on arithmetic"
    )
    assert written == run / "eval-step_000002.json"
    assert report["checkpoint"] == str(run / "checkpoints" / "step_000002")
    assert json.loads((run / "eval.json").read_text()) == {"earlier": True}


def test_a_config_whose_run_has_no_checkpoint_says_it_evaluates_the_untrained_spec(runs, capsys, tmp_path):
    fresh = tmp_path / "fresh"
    line, written, _ = evaluate(capsys, str(runs["full"] / "config.yaml"), "--set", f"run_dir={fresh}")
    assert line.startswith(
        f"evaluating the untrained model.spec tiny://arithmetic ({fresh} has no checkpoint)"
    )
    assert written == fresh / "eval-tiny-arithmetic.json"


def test_an_export_evaluated_without_a_config_writes_into_no_run_folder(runs, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(runs["lora"]), "exported"]) == 0
    capsys.readouterr()
    before = {name: files(run) for name, run in runs.items()}
    line, written, _ = evaluate(capsys, "--model", "exported")
    assert line.startswith("evaluating exported (Hugging Face model folder) on arithmetic")
    assert written == Path("eval-exported.json") and (tmp_path / written).is_file()
    assert {name: files(run) for name, run in runs.items()} == before


def test_evaluations_of_different_things_do_not_overwrite_each_other(runs, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = runs["full"]
    results = {
        evaluate(capsys, "--model", str(run / "checkpoints" / "step_000001"))[1],
        evaluate(capsys, "--model", str(run / "checkpoints" / "step_000002"))[1],
        evaluate(capsys, "--model", "tiny://arithmetic")[1],
    }
    assert results == {
        run / "eval-step_000001.json",
        run / "eval-step_000002.json",
        Path("eval-tiny-arithmetic.json"),
    }
    reports = [json.loads(path.read_text())["model"] for path in results]
    assert len(set(reports)) == 3  # each file still holds its own model's results
    explicit = tmp_path / "out" / "mine.json"
    assert evaluate(capsys, "--model", "tiny://arithmetic", "--output", str(explicit))[1] == explicit


def test_a_run_whose_newest_checkpoint_is_torn_is_evaluated_at_the_one_before(runs, capsys, caplog, tmp_path):
    run = tmp_path / "full"
    shutil.copytree(runs["full"], run)
    weights = run / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with caplog.at_level("WARNING", logger="llmrl.trainer.checkpoint"):
        line, written, report = evaluate(capsys, "--model", str(run))
    [torn] = [record.getMessage() for record in caplog.records if record.name == "llmrl.trainer.checkpoint"]
    assert "step_000002 is torn (model/model.safetensors has " in torn
    assert line.startswith(f"evaluating {run} (checkpoint step 1, its latest)")
    assert written == run / "eval-step_000001.json"
    assert report["checkpoint"] == str(run / "checkpoints" / "step_000001")
    assert (run / "checkpoints" / "step_000002.torn").is_dir()
