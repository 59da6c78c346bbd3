"""Checkpoints: everything needed to continue a run exactly, written so a crash never leaves half of one.

Layout of ``RUN_DIR/checkpoints/step_000020/``::

    model/              the policy as a plain Hugging Face folder (safetensors, config, tokenizer)
                        in the compute dtype (`model.dtype`), ready for vLLM or transformers
    master.safetensors  one process with master weights in another dtype (`training.master_dtype`)
                        only: the master weights, which a resumed run continues from
    trainer_state.pt    step, optimizer, RNG states, agent sampler cursors, evaluations (the LR
                        schedule is rebuilt from the step)
    config.yaml         the resolved run config
    manifest.json       every other file's size and CRC-32, written last: the checkpoint is complete
                        when its files match it (`checkpoint_problem`)
    sharded/            runs over several processes only: model and optimizer state written with
                        `torch.distributed.checkpoint` (each rank its shards); the optimizer is
                        here instead of in trainer_state.pt
    adapter/            LoRA runs (`model.lora`) only, instead of model/, master.safetensors and
                        sharded/: the float32 adapters in PEFT's format (adapter_config.json,
                        adapter_model.safetensors), for ``PeftModel.from_pretrained`` and vLLM's
                        ``--lora-modules`` over the base `model.spec`; ``llmrl export`` merges them.
                        Written alike by any number of processes (the adapters and their
                        optimizer state gathered whole: `gathered_optimizer_state`)

Any checkpoint resumes with any number of processes: ``sharded/`` is resharded on load (also into
one process), and a one-process checkpoint's optimizer state is keyed by parameter name and
sharded when a multi-process run loads it (`load_optimizer`).

A checkpoint is written into a hidden ``.tmp-...`` folder, its manifest last, and renamed into place,
so a folder named ``step_*`` was complete when it got its name; leftovers of a killed write are
removed on the next save, those of a failed one at once. Only the newest `keep_last` checkpoints are
kept, pruned once the new one is in place (each renamed to a hidden name before it is deleted, so
that no reader finds a ``step_*`` folder half gone).

What later tears a checkpoint (a disk that fails, a copy cut short, a file truncated by hand) is
found before the checkpoint is trusted: `latest_checkpoint`, which resuming, ``llmrl eval`` and
``llmrl export`` go through, takes the newest checkpoint whose files match its manifest, and names
each newer torn one in one line and sets it aside as ``step_NNNNNN.torn`` (never deleted: its files
may be recoverable). Checkpoints written before manifests existed have none and are trusted as they
were: their folder names were given complete.

A run folder's latest checkpoint is continued by a config that differs from the saved one only in
`RESUMABLE_CHANGES` (`checkpoint_to_resume`; ``--resume`` accepts any change); a run that starts at
step 0 clears the outputs an earlier, never-checkpointed attempt left (`clear_run_outputs`).

These are the files and the functions that write and read them; which of them a run calls, and on
which rank, is `llmrl.trainer.checkpointer`'s choice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from llmrl.config import ConfigError, RunConfig
from llmrl.errors import UserError
from llmrl.files import move_into_place
from llmrl.rollouts import BANK_FILE

_STEP_FOLDER = re.compile(r"^step_(\d+)$")
_TEMP_PREFIX = ".tmp-"
_TORN_SUFFIX = ".torn"
TRAINER_STATE = "trainer_state.pt"
MASTER_WEIGHTS = "master.safetensors"
SHARDED_STATE = "sharded"
MANIFEST = "manifest.json"
_READ_CHUNK = 16 << 20

log = logging.getLogger(__name__)


class NoCompleteCheckpointError(UserError):
    """Every checkpoint of a run folder is torn (set aside): none is left to resume or evaluate, and
    starting over in the folder would replace the outputs of the steps they hold."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """The checkpoint folders of a run as (step, folder), oldest first, their files not checked
    (`latest_checkpoint` checks them); torn ones set aside are not among them."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = checkpoint_step(child)
        if step is not None:
            found.append((step, child))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint of a run, or None while it has none.

    Newer ones whose files do not match their manifest are torn: each is named in one warning line
    and set aside as ``step_NNNNNN.torn``. When torn ones were set aside (now or by an earlier
    command) and no complete one remains, raises `NoCompleteCheckpointError` rather than answer None,
    which would start the run over."""
    for step, folder in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(folder)
        if problem is None:
            return step, folder
        _set_aside(folder, problem)
    root = checkpoints_dir(run_dir)
    torn = sorted(path.name for path in root.glob(f"step_*{_TORN_SUFFIX}*")) if root.is_dir() else []
    if torn:
        raise NoCompleteCheckpointError(
            f"{run_dir} has no complete checkpoint: the torn ones are set aside in {root} "
            f"({', '.join(torn)}); move them out of it to train the run again from step 0, "
            "or train into another run_dir"
        )
    return None


def check_named_checkpoint(folder: Path) -> None:
    """Refuse in one line a checkpoint named by its own folder whose files do not match its manifest;
    it stays in place (it was asked for by name: `latest_checkpoint` sets torn ones aside)."""
    problem = checkpoint_problem(folder)
    if problem is not None:
        raise UserError(
            f"checkpoint {folder} is torn ({problem}); name its run folder for the newest complete checkpoint"
        )


def _set_aside(folder: Path, problem: str) -> None:
    """Rename the torn checkpoint `folder` to ``step_NNNNNN.torn`` (``.torn-2``, ... when taken), out
    of every listing, and say so in one line."""
    aside = folder.with_name(folder.name + _TORN_SUFFIX)
    copies = 1
    while aside.exists():
        copies += 1
        aside = folder.with_name(f"{folder.name}{_TORN_SUFFIX}-{copies}")
    try:
        os.replace(folder, aside)
    except FileNotFoundError:
        # Gone while it was read: a live run pruned it, or another process (a rank of the same
        # torchrun job) set it aside first.
        return
    log.warning("checkpoint %s is torn (%s): set aside as %s", folder, problem, aside.name)


# ---- The manifest: what a complete checkpoint's files are ---------------------------------------------


FileRecords = dict[str, dict[str, Any]]
"""A manifest's records: a file's path in the checkpoint -> its ``bytes`` and ``crc32``."""


def write_manifest(folder: Path, summed: FileRecords | None = None) -> None:
    """Record the size and CRC-32 of every file in the written checkpoint `folder`, as its last file;
    those of `summed` are taken as they are (a sharded checkpoint's shards, summed by every rank).

    CRC-32 (zlib's) for speed: a checkpoint's files are read back once more to be summed at every
    save and once at every resume, multi-GB each, and CRC-32 reads faster than a cryptographic hash
    (see docs/training.md); it is there to find accidental damage, which it does, not tampering."""
    summed = summed or {}
    unsummed = [path for path in _files(folder) if path.relative_to(folder).as_posix() not in summed]
    files = summed | _records(folder, unsummed)
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")


def shard_records(folder: Path, rank: int, ranks: int) -> FileRecords:
    """This rank's share of the records of the checkpoint `folder`'s ``sharded/`` files: every
    `ranks`-th in name order from the `rank`-th on. Every rank sums its share once the shards are
    written, so that the rank writing the manifest does not read them all alone."""
    return _records(folder, _files(folder / SHARDED_STATE)[rank::ranks])


def _files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def _records(folder: Path, files: list[Path]) -> FileRecords:
    return {
        path.relative_to(folder).as_posix(): {"bytes": path.stat().st_size, "crc32": _crc32(path)}
        for path in files
    }


def checkpoint_problem(folder: Path) -> str | None:
    """What tears the checkpoint `folder`, in words naming the file (unreadable manifest; a file
    missing, of another size or another checksum), or None when its files match its manifest, or it
    has none (written before manifests: trusted, as its folder name was given complete). Sizes are
    compared first, which reads no file: a truncated file is found at once."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
        expected = {name: (int(entry["bytes"]), entry["crc32"]) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a bad UTF-8 byte is a ValueError
        return f"{MANIFEST} is unreadable: {exc!r}"
    for name, (size, _) in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size:,} bytes, its manifest says {size:,}"
    for name, (_, crc) in expected.items():
        try:
            if _crc32(folder / name) != crc:
                return f"{name} does not match its manifest's CRC-32"
        except FileNotFoundError:  # since its size was read: a live run pruned the checkpoint
            return f"{name} is missing"
    return None


def _crc32(path: Path) -> str:
    """The file's CRC-32 as 8 hex digits."""
    crc = 0
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as file:
        while read := file.readinto(buffer):
            crc = zlib.crc32(view[:read], crc)
    return f"{crc:08x}"


# ---- Resuming: which config changes a resume accepts, and what a fresh start clears ----------------

RESUMABLE_CHANGES = (
    # Fields (and sections) that may change between a run and its resumption without changing what it trains.
    "training.steps",
    "evaluation",
    "checkpoint",
    "logging",
    "run_dir",
    "inference.base_url",
    "inference.api_key_env",
    "inference.request_timeout_s",
    "inference.weights_dir",
    "inference.weight_sync_timeout_s",
    "inference.weight_sync_bucket_mb",
    "inference.vllm",
)
_RUN_OUTPUTS = (
    "metrics.jsonl",
    "rollouts.jsonl",
    "trace.json",
    "summary.json",
    "curves.png",
    "tensorboard",
    BANK_FILE,
)
"""Written fresh by a run that starts from step 0."""


def checkpoint_to_resume(config: RunConfig, force: bool) -> tuple[int, Path] | None:
    """The run folder's latest checkpoint when this config may continue it; errors explain when not.

    The configs are compared as they are saved: the objects a config built in Python holds by their
    descriptions (`llmrl.config.describe_python_object`), so the same Python call resumes: a function
    or class is the same by its ``module:qualname``, a `datasets.Dataset` by its fingerprint."""
    latest = latest_checkpoint(config.run_dir)
    if latest is None:
        if force:
            raise ConfigError(f"--resume: {config.run_dir} has no checkpoint to resume from")
        return None
    saved = yaml.safe_load((latest[1] / "config.yaml").read_text())
    changes = _config_changes(saved, config.model_dump(mode="json"))
    blocking = [c for c in changes if not c.split(":")[0].startswith(RESUMABLE_CHANGES)]
    if blocking and not force:
        raise ConfigError(
            f"run_dir {config.run_dir} holds a checkpoint at step {latest[0]} of a different config "
            f"({'; '.join(blocking[:5])}). Pass --resume (llmrl.train: resume=True) to continue it with this "
            "config, or choose a new run_dir."
        )
    return latest


def _config_changes(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            change
            for key in sorted(set(old) | set(new))
            for change in _config_changes(old.get(key), new.get(key), f"{path}.{key}" if path else key)
        ]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [
            change
            for index, (was, now) in enumerate(zip(old, new, strict=True))
            for change in _config_changes(was, now, f"{path}[{index}]")
        ]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def clear_run_outputs(run_dir: Path) -> None:
    """A run starting at step 0 replaces what an earlier, never-checkpointed attempt left."""
    for name in _RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: Any,
    tokenizer: Any,
    trainer_state: dict[str, Any],
    config_yaml: str,
    keep_last: int,
    model_state: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the checkpoint of `step` atomically, then delete all but the newest `keep_last`.

    `model_state` and `dtype` as for `write_checkpoint_files`; weights of another dtype than `dtype`
    (master weights) are also kept as they are, for `load_master_weights`."""
    temp = start_checkpoint(run_dir, step)
    write_checkpoint_files(
        temp,
        model=model,
        tokenizer=tokenizer,
        trainer_state=trainer_state,
        config_yaml=config_yaml,
        model_state=model_state,
        dtype=dtype,
    )
    state = model_state if model_state is not None else model.state_dict()
    if dtype is not None and any(
        value.dtype != dtype for value in state.values() if value.is_floating_point()
    ):
        save_file({name: value.contiguous() for name, value in state.items()}, temp / MASTER_WEIGHTS)
    return finish_checkpoint(run_dir, step, temp, keep_last=keep_last)


def load_master_weights(checkpoint: str | Path, model: torch.nn.Module) -> None:
    """Put a one-process checkpoint's master weights into `model` (loaded from its compute-dtype
    folder), if it kept any."""
    path = Path(checkpoint) / MASTER_WEIGHTS
    if path.is_file():
        with torch.no_grad():
            model.load_state_dict(load_file(path, device=str(next(model.parameters()).device)), strict=False)


def start_checkpoint(run_dir: str | Path, step: int) -> Path:
    """The empty temporary folder to write the checkpoint of `step` into (leftovers of killed saves
    removed)."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_partial_checkpoints(run_dir)  # a save killed half-way
    temp = root / f"{_TEMP_PREFIX}step_{step:06d}-{os.getpid()}"
    temp.mkdir()
    return temp


def remove_partial_checkpoints(run_dir: str | Path) -> None:
    """Delete the temporary folders of saves that did not finish (killed, or failed to write)."""
    for partial in checkpoints_dir(run_dir).glob(f"{_TEMP_PREFIX}*"):
        shutil.rmtree(partial, ignore_errors=True)


def write_checkpoint_files(
    temp: Path,
    *,
    model: Any,
    tokenizer: Any,
    trainer_state: dict[str, Any],
    config_yaml: str,
    model_state: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """The model folder, trainer state and config; `model_state` (the full weights) replaces the
    model's own state dict (a sharded model's). With `dtype`, the folder's floating-point weights
    are written in it and its config names it (not the dtype of the weights handed over)."""
    if dtype is not None:
        source = model_state if model_state is not None else model.state_dict()
        model_state = {
            name: value.to(dtype) if value.is_floating_point() else value for name, value in source.items()
        }
    model.save_pretrained(temp / "model", safe_serialization=True, state_dict=model_state)
    if dtype is not None:
        config_path = temp / "model" / "config.json"
        config = json.loads(config_path.read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(temp / "model")
    write_run_state(temp, trainer_state=trainer_state, config_yaml=config_yaml)


def write_run_state(temp: Path, *, trainer_state: dict[str, Any], config_yaml: str) -> None:
    """The trainer state and config of a checkpoint (beside its model folder or adapter)."""
    # Through a Python file: a failed write (a full disk) then leaves its OSError behind torch's
    # error, where writing to a path reports only a short write.
    with open(temp / TRAINER_STATE, "wb") as file:
        torch.save(trainer_state, file)
    (temp / "config.yaml").write_text(config_yaml)


def finish_checkpoint(
    run_dir: str | Path, step: int, temp: Path, *, keep_last: int, summed: FileRecords | None = None
) -> Path:
    """Write the manifest of the written `temp` folder (`summed`: records of files already summed) and
    move it into place as the checkpoint of `step`; keep the newest `keep_last`. Every mode finishes
    its checkpoints here, on the rank that writes them, once every rank's files are written (the
    manifest covers the shards too)."""
    root = checkpoints_dir(run_dir)
    final = root / f"step_{step:06d}"
    write_manifest(temp, summed)
    _fsync_tree(temp)
    move_into_place(temp, final)  # re-saving a step after a resume: the new copy replaces the old one
    _fsync_dir(root)
    # The new checkpoint is the newest (a resume starts from the newest complete one, torn newer ones
    # set aside), so pruning keeps it whatever `keep_last` (at least 1) is.
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        pruned = root / f"{_TEMP_PREFIX}pruned-{old.name}-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):  # a reader found it torn and set it aside
            os.replace(old, pruned)  # a kill during the delete leaves a leftover the next save removes
        shutil.rmtree(pruned, ignore_errors=True)
    return final


def save_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Write the model's (and optimizer's) state with `torch.distributed.checkpoint` into ``folder/sharded``.

    Collective: every rank calls it and writes its own shards."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=folder / SHARDED_STATE)


def has_sharded_state(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / SHARDED_STATE).is_dir()


def load_optimizer(
    checkpoint: str | Path,
    trainer_state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    sharded_model: bool,
) -> bool:
    """Restore the optimizer (and, from ``sharded/``, the weights) of a checkpoint written by any
    number of processes into this `model` (sharded or not). False when the checkpoint has none."""
    if has_sharded_state(checkpoint):
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if trainer_state.get("sharded_optimizer"):
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)  # the layout to load into
        with warnings.catch_warnings():  # one process loads without a process group, which DCP notes
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=Path(checkpoint) / SHARDED_STATE)
        set_model_state_dict(model, state["model"])
        if "optimizer" not in state:
            return False
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        return True
    if "optimizer" not in trainer_state:
        return False
    if not sharded_model:
        optimizer.load_state_dict(trainer_state["optimizer"])
        return True
    # A one-process checkpoint: its state is keyed by position in the parameter list; the sharded
    # model has the same parameters in the same order, so name them and let each rank take its shards.
    names = _trainable_names(model)
    saved = trainer_state["optimizer"]
    by_name = {
        "state": {names[index]: value for index, value in saved["state"].items()},
        "param_groups": [
            group | {"params": [names[i] for i in group["params"]]} for group in saved["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
    return True


def gathered_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A sharded model's optimizer state, whole, in one process's format (`optimizer.state_dict()`:
    keyed by position among the trainable parameters), which `load_optimizer` restores into any
    number of processes. For a state small enough to gather (LoRA's adapters). Collective."""
    whole = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    positions = {name: index for index, name in enumerate(_trainable_names(model))}
    return {
        "state": {positions[name]: value for name, value in whole["state"].items()},
        "param_groups": [
            group | {"params": [positions[name] for name in group["params"]]}
            for group in whole["param_groups"]
        ],
    }


def _trainable_names(model: torch.nn.Module) -> list[str]:
    """The names of the parameters the optimizer holds, in its order (`build_optimizer`)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


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


def checkpoint_step(folder: str | Path) -> int | None:
    """The step of a checkpoint folder (``step_NNNNNN`` with its manifest, or before manifests its
    trainer state), else None; its files are not checked (`checkpoint_problem`)."""
    folder = Path(folder)
    match = _STEP_FOLDER.match(folder.name)
    is_checkpoint = (folder / MANIFEST).is_file() or (folder / TRAINER_STATE).is_file()
    return int(match.group(1)) if match and is_checkpoint else None


def checkpoint_run_dir(checkpoint: str | Path) -> Path | None:
    """The run folder a checkpoint folder lies in (``RUN/checkpoints/step_NNNNNN``), if it lies in one."""
    checkpoint = Path(checkpoint)
    run_dir = checkpoint.parent.parent
    return run_dir if checkpoints_dir(run_dir) == checkpoint.parent else None


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
