"""Checkpoints of `llmrl serve-tinker` in its storage folder, named by Tinker paths.

``tinker://RUN/weights/NAME`` (``save_state``: the adapter and the optimizer state) and
``tinker://RUN/sampler_weights/NAME`` (``save_weights_for_sampler``: the adapter only) are the folders
``STORAGE/RUN/weights/NAME`` and ``STORAGE/RUN/sampler_weights/NAME``, where RUN is the training
client's model id. Each holds PEFT's adapter files (``adapter_model.safetensors``,
``adapter_config.json``), ``optimizer.pt`` for training checkpoints, and ``checkpoint.json``: what the
adapter was made on (base model, rank, LoRA switches), when, and the caller's metadata. A checkpoint is
written to a temporary folder and renamed into place, so that a server killed mid-save leaves no torn
checkpoint behind.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tinker import types

from llmrl.server.tinker.wire import Refused

KIND_FOLDERS = {"weights": "training", "sampler_weights": "sampler"}
"""A Tinker path's middle part and the checkpoint type the SDK lists it as."""
ADAPTER_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RECORD_FILE = "checkpoint.json"


@dataclass(frozen=True)
class CheckpointPath:
    """``tinker://RUN/KIND/NAME``, parsed."""

    run_id: str
    kind: str
    name: str

    @classmethod
    def parse(cls, tinker_path: str, field: str) -> CheckpointPath:
        parts = tinker_path.removeprefix("tinker://").split("/")
        if not tinker_path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KIND_FOLDERS:
            raise Refused(
                400,
                f"{field}: {tinker_path!r} is not a checkpoint path (tinker://RUN/weights|sampler_weights/NAME)",
            )
        return cls.of(*parts, field=field)

    @classmethod
    def of(cls, run_id: str, kind: str, name: str, *, field: str) -> CheckpointPath:
        for part in (run_id, name):
            if not part or part in (".", "..") or "/" in part or "\\" in part:
                raise Refused(400, f"{field}: {part!r} cannot name a checkpoint")
        return cls(run_id, kind, name)

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    def folder(self, storage: Path) -> Path:
        return storage / self.run_id / self.kind / self.name


@dataclass(frozen=True)
class AdapterRecord:
    """What a checkpoint's adapter was made on: a training client restored from it is made the same."""

    base_model: str
    rank: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool

    def lora_config(self) -> types.LoraConfig:
        return types.LoraConfig(
            rank=self.rank,
            train_mlp=self.train_mlp,
            train_attn=self.train_attn,
            train_unembed=self.train_unembed,
        )


def save_checkpoint(
    path: CheckpointPath,
    storage: Path,
    *,
    peft_model: Any,
    adapter: AdapterRecord,
    optimizer: torch.optim.Optimizer | None,
    user_metadata: dict[str, str] | None,
    overwrite: bool,
) -> None:
    """Write the adapter (and the optimizer's state) under `path`, whole or not at all."""
    folder = path.folder(storage)
    if folder.exists() and not overwrite:
        raise Refused(400, f"path: {path.tinker_path} exists (save with overwrite=True to replace it)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=folder.parent))
    try:
        peft_model.save_pretrained(staging, save_embedding_layers=False)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), staging / OPTIMIZER_FILE)
        record = {
            "adapter": adapter.__dict__,
            "time": datetime.now(UTC).isoformat(),
            "user_metadata": user_metadata or {},
        }
        (staging / RECORD_FILE).write_text(json.dumps(record, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def checkpoint_folder(path: CheckpointPath, storage: Path, field: str) -> Path:
    folder = path.folder(storage)
    if not (folder / RECORD_FILE).is_file():
        raise Refused(404, f"{field}: no checkpoint {path.tinker_path} in {storage}")
    return folder


def adapter_record(folder: Path) -> AdapterRecord:
    return AdapterRecord(**json.loads((folder / RECORD_FILE).read_text())["adapter"])


def load_adapter(peft_model: Any, folder: Path) -> None:
    """The checkpoint's adapter weights into `peft_model` (made with the same `AdapterRecord`)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(folder / ADAPTER_FILE, device=str(next(peft_model.parameters()).device))
    result = set_peft_model_state_dict(peft_model, weights)
    missing = [key for key in result.missing_keys if "lora_" in key]
    if missing:
        raise Refused(400, f"path: the checkpoint has no weights for {missing[0]} (a different adapter)")


def load_optimizer(optimizer: torch.optim.Optimizer, folder: Path, tinker_path: str) -> None:
    state = folder / OPTIMIZER_FILE
    if not state.is_file():
        raise Refused(400, f"optimizer: {tinker_path} holds no optimizer state (a sampler checkpoint)")
    optimizer.load_state_dict(torch.load(state, map_location="cpu", weights_only=True))


def list_checkpoints(storage: Path, run_id: str | None = None) -> list[types.Checkpoint]:
    """The checkpoints of run `run_id` (every run's when None), oldest first."""
    runs = [storage / run_id] if run_id is not None else sorted(p for p in storage.glob("*") if p.is_dir())
    found = []
    for run in runs:
        for kind, checkpoint_type in KIND_FOLDERS.items():
            for folder in sorted((run / kind).glob("*")):
                if not (folder / RECORD_FILE).is_file():
                    continue  # a save in progress (a hidden staging folder)
                record = json.loads((folder / RECORD_FILE).read_text())
                path = CheckpointPath(run.name, kind, folder.name)
                found.append(
                    types.Checkpoint(
                        checkpoint_id=path.checkpoint_id,
                        checkpoint_type=checkpoint_type,
                        time=datetime.fromisoformat(record["time"]),
                        tinker_path=path.tinker_path,
                        size_bytes=sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
                        user_metadata=record["user_metadata"] or None,
                    )
                )
    return sorted(found, key=lambda checkpoint: checkpoint.time)


def delete_checkpoint(storage: Path, run_id: str, checkpoint_id: str) -> None:
    kind, _, name = checkpoint_id.partition("/")
    if kind not in KIND_FOLDERS:
        raise Refused(400, f"checkpoint_id: {checkpoint_id!r} is not weights/NAME or sampler_weights/NAME")
    path = CheckpointPath.of(run_id, kind, name, field="checkpoint_id")
    shutil.rmtree(checkpoint_folder(path, storage, "checkpoint_id"))
