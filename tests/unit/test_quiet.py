"""The commands leave out the libraries' warnings, log lines and progress bars unless run with --verbose,
and keep llmrl's own (llmrl/quiet.py); scripts/setup.sh installs without setuptools' editable-install
note. The commands run in processes of their own: the switches hold for the rest of a process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmrl.cli import build_parser

REPO = Path(__file__).resolve().parents[2]

COMMAND_THEN_SAY = """
import logging, sys, warnings
from llmrl.cli import main

status = main(sys.argv[1:])
logging.getLogger("llmrl.agents").warning("llmrl's own line")
logging.getLogger("math_verify.grader").warning("a library's line")
warnings.warn_explicit("llmrl's own warning", UserWarning, "own.py", 1, module="llmrl.agents.multi_task")
warnings.warn_explicit("a library's warning", UserWarning, "lib.py", 1, module="transformers.modeling_utils")
import datasets.utils

print("datasets bars", "off" if datasets.utils.are_progress_bars_disabled() else "on")
sys.exit(status)
"""


def run_command(*args: str) -> subprocess.CompletedProcess:
    """`llmrl ARGS`, then a line and a warning each of llmrl's and of a library's."""
    set_by_quiet = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "DATASETS_VERBOSITY")
    env = {name: value for name, value in os.environ.items() if name not in set_by_quiet}
    return subprocess.run(
        [sys.executable, "-c", COMMAND_THEN_SAY, *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_a_command_shows_llmrl_s_lines_and_no_library_s_unless_verbose(tmp_path):
    quiet = run_command("export", "tiny://arithmetic", str(tmp_path / "quiet"))
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.endswith("datasets bars off\n")
    assert "llmrl's own line\n" in quiet.stderr and "UserWarning: llmrl's own warning\n" in quiet.stderr
    for hidden in ("Loading weights", "Writing model shards", "library's line", "library's warning"):
        assert hidden not in quiet.stderr
    verbose = run_command("export", "--verbose", "tiny://arithmetic", str(tmp_path / "verbose"))
    assert verbose.returncode == 0, verbose.stderr
    assert verbose.stdout.endswith("datasets bars on\n")
    for shown in ("Loading weights", "own line", "library's line", "own warning", "library's warning"):
        assert shown in verbose.stderr


COMMAND_LINES = {
    "train": [],
    "eval": [],
    "serve-env": ["run.yaml"],
    "serve-inference": ["--model", "tiny://arithmetic"],
    "export": ["tiny://arithmetic", "out"],
}


@pytest.mark.parametrize("command", COMMAND_LINES)
def test_every_command_that_loads_libraries_takes_verbose(command):
    parser = build_parser()
    assert parser.parse_args([command, *COMMAND_LINES[command]]).verbose is False
    assert parser.parse_args([command, "--verbose", *COMMAND_LINES[command]]).verbose is True


def test_setup_installs_llmrl_without_setuptools_note_on_editable_installs(tmp_path):
    """The note printed before the demo's first line: a folder named like the package may shadow it."""
    (note,) = re.findall(r'^editable_note="(.+)"$', (REPO / "scripts/setup.sh").read_text(), re.MULTILINE)
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (tmp_path / "README.md").write_text("llmrl\n")
    (tmp_path / "llmrl").mkdir()
    (tmp_path / "llmrl" / "__init__.py").touch()
    build = "import sys; from setuptools import build_meta; build_meta.build_editable(sys.argv[1])"

    def build_editable(warning_filters: str) -> str:
        """What the build backend pip runs prints on stderr."""
        done = subprocess.run(
            [sys.executable, "-c", build, str(tmp_path / "wheel")],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": warning_filters},
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert "InformationOnly: Editable installation." in build_editable("")
    assert "Warning" not in build_editable(note)
