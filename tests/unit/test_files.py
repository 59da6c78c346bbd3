"""Writes that readers never see half-done (llmrl/files.py)."""

import os
import stat

import pytest

from llmrl.files import atomic_write, move_into_place, replacing


def test_atomic_write_replaces_the_file_readable_by_all_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    atomic_write(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert os.listdir(tmp_path) == ["summary.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "bank.jsonl"
    path.write_text("old")
    with pytest.raises(RuntimeError), replacing(path) as temp:
        temp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["bank.jsonl"]


def test_a_folder_replaces_a_folder(tmp_path):
    old, new = tmp_path / "step_000002", tmp_path / ".tmp-step_000002"
    old.mkdir()
    (old / "stale").write_text("old")
    new.mkdir()
    (new / "model").write_text("new")
    move_into_place(new, old)
    assert os.listdir(old) == ["model"] and os.listdir(tmp_path) == ["step_000002"]
