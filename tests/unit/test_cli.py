"""The `llmrl` command: help for every subcommand, config show, clear errors and exit codes."""

import importlib.metadata
import re
import subprocess
import sys

import pytest
import yaml

from llmrl.cli import EXIT_USAGE, main

SUBCOMMANDS = ["train", "eval", "serve-env", "serve-inference", "export", "config"]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_for_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "usage: llmrl " + command in capsys.readouterr().out


def test_version_is_the_installed_distribution_s(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"llmrl {importlib.metadata.version('llmrl')}"


def test_config_show_prints_resolved_config(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("environments:\n  - agent_type: arithmetic\ntraining:\n  steps: 5\n")
    assert main(["config", "show", str(path), "--set", "training.lr=3e-4"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["training"]["steps"] == 5
    assert shown["training"]["lr"] == 3e-4
    assert shown["algorithm"]["advantage_estimator"] == "grpo"  # defaults are filled in


def test_config_errors_exit_2_with_the_field_named(tmp_path, capsys):
    assert main(["config", "show", "--set", "training.lr=fast"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "llmrl config: error: training.lr: expected a number, got 'fast'" in err
    assert main(["config", "show", str(tmp_path / "missing.yaml")]) == EXIT_USAGE
    assert "config file not found" in capsys.readouterr().err


def test_serve_env_with_a_bad_config_exits_2_before_listening(tmp_path, capsys):
    assert main(["serve-env", str(tmp_path / "missing.yaml")]) == EXIT_USAGE
    assert "config file not found" in capsys.readouterr().err
    config = tmp_path / "env.yaml"
    config.write_text("environments: [{agent_type: nope}]\n")
    assert main(["serve-env", str(config)]) == EXIT_USAGE
    assert "unknown agent type 'nope'" in capsys.readouterr().err


def test_console_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "llmrl", "config", "show"], capture_output=True, text=True, check=True
    )
    assert yaml.safe_load(result.stdout)["model"]["spec"] == "tiny://arithmetic"


def test_a_bad_model_spec_deep_inside_a_command_exits_2(tmp_path, capsys):
    assert main(["export", str(tmp_path / "no-such-model"), str(tmp_path / "out")]) == EXIT_USAGE
    assert f"no folder {tmp_path / 'no-such-model'}\n" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(config):
        raise ValueError("an invariant of ours broke")  # not the user's mistake: no ConfigError or UserError

    monkeypatch.setattr("llmrl.cli.dump_config", broken)
    with pytest.raises(ValueError, match="an invariant of ours broke"):
        main(["config", "show"])


def test_a_run_that_cannot_fit_is_refused_before_any_weights_load(tmp_path, capsys, tiny_model_path):
    """The memory plan: a micro-batch far beyond the machine's memory stops `llmrl train` with the
    plan and what would fit, and nothing is written to the run folder."""
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "--set",
            f"run_dir={run_dir}",
            "--set",
            "training.micro_batch_tokens=100000000",
            "--set",
            "training.pack_row_tokens=512",
            "--set",
            "logging.progress=off",
        ]
    )
    assert code == EXIT_USAGE
    error = capsys.readouterr().err
    assert re.search(r"per rank but (cpu|cuda) has", error) and "activations" in error
    assert "training.micro_batch_tokens:" in error  # the largest that fits
    assert not run_dir.exists()
