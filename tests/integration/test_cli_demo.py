"""The README's demo path end to end: `llmrl train` / `llmrl eval` on the tiny model and arithmetic."""

import json
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.slow

SMALL = [
    "--set",
    "evaluation.num_prompts=8",
    "--set",
    "evaluation.samples_per_prompt=4",
    "--set",
    "evaluation.ks=[1, 4]",
]


def _llmrl(*argv, cwd):
    return subprocess.run(
        [sys.executable, "-m", "llmrl", *argv], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def test_train_demo_writes_run_folder(tmp_path, tiny_model):
    result = _llmrl(
        "train", "--set", f"run_dir={tmp_path / 'run'}", "--set", "training.steps=2", *SMALL, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["spec"] == "tiny://arithmetic"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2
    for key in ("eval_start", "eval_end"):
        metrics = summary[key]["arithmetic"]
        assert metrics["problems"] == 8
        assert set(metrics) >= {"pass@1", "pass@4", "greedy_accuracy", "reward_mean"}
        assert 0.0 <= metrics["pass@1"] <= metrics["pass@4"] <= 1.0
    assert "step 2/2" in result.stdout  # plain progress lines off a terminal
    assert "arithmetic: sampled accuracy (pass@1)" in result.stdout and "points" in result.stdout

    again = _llmrl("train", "--set", f"run_dir={run}", "--set", "training.steps=2", *SMALL, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stdout and "step 1/2" not in again.stdout  # a finished run does not retrain


def test_eval_with_bad_agent_args_names_the_environment(tmp_path, tiny_model):
    result = _llmrl("eval", "--set", "environments.0.agent_args.digitz=2", cwd=tmp_path)
    assert result.returncode == 2
    assert "environment 'arithmetic'" in result.stderr and "digitz" in result.stderr


def test_export_writes_a_plain_hugging_face_folder(tmp_path, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exported"
    result = _llmrl("export", "tiny://arithmetic", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    model, tokenizer = tiny_model
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).encode("What is 12 + 34?") == tokenizer.encode(
        "What is 12 + 34?"
    )
    ids = torch.tensor([tokenizer.encode("What is 12 + 34?")])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, model(ids).logits)
    again = _llmrl("export", "tiny://arithmetic", str(out), cwd=tmp_path)
    assert again.returncode == 2 and "must not exist or be empty" in again.stderr
