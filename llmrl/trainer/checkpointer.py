"""This run's checkpoints, written and restored the way its mode needs (the files and their layout:
`llmrl.trainer.checkpoint`).

One `Checkpointer` per run, chosen from the mode once (`checkpointer_for`), so that the loop saves
with one call whatever the mode: one process writes its full weights itself; FSDP2 shards are written
by every rank (``sharded/``) while rank 0 writes the Hugging Face folder from weights gathered bucket
by bucket; a LoRA run saves its adapters alone, gathered whole and written by rank 0 from any number
of processes. The checkpointer decides what its rank does (who writes, who waits for whom), and adds
to the loop's own state what it restores itself: the global RNG states and the optimizer. Which
checkpoint a run resumes from is rank 0's choice alone (`resume_point`): it checks the files and sets
torn checkpoints aside.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmrl.config import RunConfig, dump_config
from llmrl.errors import UserError
from llmrl.files import os_error_behind
from llmrl.trainer import checkpoint as ckpt
from llmrl.trainer.distributed import Distributed, OneProcess
from llmrl.trainer.lora import ADAPTER_FOLDER
from llmrl.trainer.policy import PolicyModels
from llmrl.trainer.run_folder import write_failure


class Checkpointer(ABC):
    """Saves the checkpoint of a step and restores one, for one mode."""

    def __init__(
        self,
        config: RunConfig,
        models: PolicyModels,
        optimizer: torch.optim.Optimizer,
        distributed: Distributed | None,
    ):
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.models = models
        self.optimizer = optimizer
        self.distributed = distributed
        self.writes = distributed is None or distributed.is_main
        """Whether this rank writes the checkpoint's files (all but the shards)."""

    def due(self, step: int, last_step: int) -> bool:
        """Whether the loop saves after `step` (every `checkpoint.every` steps, and at the end)."""
        every = self.config.checkpoint.every
        return (every > 0 and step % every == 0) or step == last_step

    def save(self, step: int, trainer_state: Callable[[], dict[str, Any]]) -> None:
        """Write the checkpoint of `step`; every rank calls it, and returns once it is in place.

        `trainer_state` gives the loop's own state (step, evaluations, the agents' cursors); it is
        called on the rank that writes the checkpoint alone. A save that fails leaves no partial
        folder and the checkpoints before it as they were; one that the file system refused (a full
        disk, a read-only one) raises `RunFolderWriteError`."""
        try:
            self._write(step, trainer_state)
        except Exception as exc:
            if self.writes:
                ckpt.remove_partial_checkpoints(self.run_dir)
            error = os_error_behind(exc)
            if error is None:
                raise
            where = f"the checkpoint of step {step} into {ckpt.checkpoints_dir(self.run_dir)}"
            raise write_failure(where, error, self.run_dir) from exc

    @abstractmethod
    def _write(self, step: int, trainer_state: Callable[[], dict[str, Any]]) -> None:
        """`save` for this mode."""

    def restore(self, folder: Path) -> dict[str, Any]:
        """Put the RNG states and the optimizer (and a sharded checkpoint's weights) of `folder` back;
        returns the saved state, the loop's included."""
        state = ckpt.load_trainer_state(folder)
        ckpt.set_rng_state(state["rng"])
        # A checkpoint without the optimizer's state leaves it new: Adam starts over.
        sharded_model = self.distributed is not None
        ckpt.load_optimizer(folder, state, self.models.policy, self.optimizer, sharded_model=sharded_model)
        return state

    def _run_state(
        self, trainer_state: Callable[[], dict[str, Any]], optimizer: dict[str, Any]
    ) -> dict[str, Any]:
        return trainer_state() | {"rng": ckpt.rng_state()} | optimizer

    def _finish(self, step: int, temp: Path, summed: ckpt.FileRecords | None = None) -> None:
        ckpt.finish_checkpoint(
            self.run_dir, step, temp, keep_last=self.config.checkpoint.keep_last, summed=summed
        )


class FullCheckpointer(Checkpointer):
    """One process: the model folder (and master weights of another dtype), the optimizer in the state."""

    def _write(self, step: int, trainer_state: Callable[[], dict[str, Any]]) -> None:
        optimizer = (
            {"optimizer": self.optimizer.state_dict()} if self.config.checkpoint.save_optimizer else {}
        )
        ckpt.save_checkpoint(
            self.run_dir,
            step,
            model=self.models.policy,
            tokenizer=self.models.tokenizer,
            trainer_state=self._run_state(trainer_state, optimizer),
            config_yaml=dump_config(self.config),
            keep_last=self.config.checkpoint.keep_last,
            model_state=self.models.untied_state_dict(),
            dtype=self.models.compute_dtype,
        )


class ShardedCheckpointer(Checkpointer):
    """Several processes, every weight trained: every rank writes its shards of the model and
    optimizer, and sums its share of them for the manifest; rank 0 writes the Hugging Face folder
    (gathered weights), the rest, and renames."""

    def _write(self, step: int, trainer_state: Callable[[], dict[str, Any]]) -> None:
        distributed, models = self.distributed, self.models
        assert distributed is not None
        weights: dict[
            str, torch.Tensor
        ] = {}  # in the compute dtype the folder is written in: no float32 copy
        for bucket in distributed.gathered_buckets(
            models.policy,
            self.config.inference.weight_sync_bucket_mb << 20,
            held_on="cpu" if distributed.is_main else None,
            skip=models.tied_names,
            dtype=models.compute_dtype,
        ):
            weights |= bucket
        temp = distributed.broadcast_object(
            ckpt.start_checkpoint(self.run_dir, step) if self.writes else None
        )
        save_optimizer = self.config.checkpoint.save_optimizer
        ckpt.save_sharded(temp, models.policy, self.optimizer if save_optimizer else None)
        shares = distributed.all_gather_object(
            ckpt.shard_records(temp, distributed.rank, distributed.world_size)
        )
        summed = {name: record for share in shares for name, record in share.items()}
        if self.writes:
            ckpt.write_checkpoint_files(
                temp,
                model=models.policy,
                tokenizer=models.tokenizer,
                trainer_state=self._run_state(
                    trainer_state, {"sharded_optimizer": True} if save_optimizer else {}
                ),
                config_yaml=dump_config(self.config),
                model_state=weights,
                dtype=models.compute_dtype,
            )
            self._finish(step, temp, summed)
        distributed.barrier()  # nobody goes on (or resumes) before the checkpoint is in place


class AdapterCheckpointer(Checkpointer):
    """A LoRA run, the same from any number of processes: the adapters alone (the base is `model.spec`)
    and their optimizer state, gathered whole on every rank (small), written by rank 0."""

    def _write(self, step: int, trainer_state: Callable[[], dict[str, Any]]) -> None:
        adapters = self.models.adapters
        assert adapters is not None
        weights = adapters.weights()
        optimizer: dict[str, Any] = {}
        if self.config.checkpoint.save_optimizer:
            optimizer["optimizer"] = (
                self.optimizer.state_dict()
                if self.distributed is None
                else ckpt.gathered_optimizer_state(self.models.policy, self.optimizer)
            )
        if self.writes:
            temp = ckpt.start_checkpoint(self.run_dir, step)
            weights.save(temp / ADAPTER_FOLDER)
            ckpt.write_run_state(
                temp,
                trainer_state=self._run_state(trainer_state, optimizer),
                config_yaml=dump_config(self.config),
            )
            self._finish(step, temp)
        if self.distributed is not None:
            self.distributed.barrier()  # nobody goes on (or resumes) before the checkpoint is in place


def resume_point(
    config: RunConfig, force: bool, processes: Distributed | OneProcess
) -> tuple[int, Path] | None:
    """The checkpoint this run continues from (`ckpt.checkpoint_to_resume`), or None to start at step 0.

    Rank 0 chooses, reading the checkpoints' files once and setting torn ones aside without another
    rank renaming them under it; every rank gets its choice, or the error that refuses the resume."""
    choice: tuple[int, Path] | UserError | None = None
    if processes.is_main:
        try:
            choice = ckpt.checkpoint_to_resume(config, force)
        except UserError as refusal:
            choice = refusal
    choice = processes.broadcast_object(choice)
    if isinstance(choice, UserError):
        raise choice
    return choice


def checkpointer_for(
    config: RunConfig,
    models: PolicyModels,
    optimizer: torch.optim.Optimizer,
    distributed: Distributed | None,
) -> Checkpointer:
    """The checkpointer this run's mode needs (LoRA, FSDP2 shards, or one process)."""
    if models.adapters is not None:
        return AdapterCheckpointer(config, models, optimizer, distributed)
    if distributed is not None:
        return ShardedCheckpointer(config, models, optimizer, distributed)
    return FullCheckpointer(config, models, optimizer, distributed)
