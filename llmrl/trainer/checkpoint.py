"""Checkpoints: everything needed to continue a run exactly, written so a crash never leaves half of one.

Layout of ``RUN_DIR/checkpoints/step_000020/``::

    model/              the policy as a plain Hugging Face folder (safetensors, config, tokenizer)
    trainer_state.pt    step, optimizer, LR schedule, RNG states, agent sampler cursors, evaluations
    config.yaml         the resolved run config

A checkpoint is written into a hidden ``.tmp-...`` folder and renamed into place, so a folder named
``step_*`` is always complete; leftovers of a killed write are removed on the next save. Only the
newest `keep_last` checkpoints are kept.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

_STEP_FOLDER = re.compile(r"^step_(\d+)$")
_TEMP_PREFIX = ".tmp-"
TRAINER_STATE = "trainer_state.pt"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, folder), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_FOLDER.match(child.name)
        if match and (child / TRAINER_STATE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint of a run, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: Any,
    tokenizer: Any,
    trainer_state: dict[str, Any],
    config_yaml: str,
    keep_last: int,
) -> Path:
    """Write the checkpoint of `step` atomically, then delete all but the newest `keep_last`."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{_TEMP_PREFIX}*"):  # a save killed half-way
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step:06d}"
    temp = root / f"{_TEMP_PREFIX}{final.name}-{os.getpid()}"
    model.save_pretrained(temp / "model", safe_serialization=True)
    tokenizer.save_pretrained(temp / "model")
    torch.save(trainer_state, temp / TRAINER_STATE)
    (temp / "config.yaml").write_text(config_yaml)
    _fsync_tree(temp)
    if final.exists():  # re-saving a step after a resume: the new copy replaces the old one
        shutil.rmtree(final)
    os.replace(temp, final)
    _fsync_dir(root)
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    """The `trainer_state` saved in a checkpoint folder."""
    path = Path(checkpoint) / TRAINER_STATE
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint}: not a checkpoint folder (no {TRAINER_STATE})")
    return torch.load(path, map_location="cpu", weights_only=True)


def rng_state() -> dict[str, Any]:
    """The global RNG states a run may draw from (Python, torch CPU and CUDA)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resolve_model_folder(path: str | Path) -> Path | None:
    """The Hugging Face model folder inside a checkpoint or run folder (its latest checkpoint), if any."""
    path = Path(path)
    if (path / "model" / "config.json").is_file():
        return path / "model"
    latest = latest_checkpoint(path)
    return latest[1] / "model" if latest else None


def _fsync_tree(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        _fsync_dir(sub)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
