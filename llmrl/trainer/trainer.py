"""The RL loop: collect rollouts, compute advantages and the loss, update, sync weights, evaluate, save.

`Trainer(config).run()` is the whole of ``llmrl train``. One step::

    groups   = agents.group_rollouts(inference, prompts_per_step, group_size)   generate + reward
    batch    = prepare_batch(groups)                                            shaping, advantages
    metrics  = update(batch)                                                    logprobs, loss, AdamW
    inference.update_weights(policy.state_dict(), version=step)                 weight sync

with evaluation at the start, every `evaluation.every` steps and at the end, and a checkpoint every
`checkpoint.every` steps and at the end. A run folder that already holds a checkpoint of the same
config is resumed from it; see `llmrl.trainer.checkpoint` for what is saved. Resumed runs end with
the same weights as uninterrupted ones: every random choice is derived from `config.seed` and the
step (generation seeds per request, mini-batch order), and the rest of the state is checkpointed.

Under ``torchrun`` (more than one process) the policy is sharded over the processes
(`llmrl.trainer.distributed`): rank 0 alone generates, evaluates and writes the run folder, and
broadcasts each step's rollouts; every rank trains on its share of the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import transformers

from llmrl.agents import build_agents
from llmrl.config import ConfigError, RunConfig, dump_config
from llmrl.evaluation import Summary, evaluate_environments
from llmrl.files import atomic_write
from llmrl.inference import InferenceInterface, build_inference, run_sync
from llmrl.models import load_model
from llmrl.models.loading import DTYPES, enable_activation_checkpointing
from llmrl.registry import import_plugins
from llmrl.seeding import derive_seed
from llmrl.telemetry import MetricsLogger, RolloutLog, Tracer, read_metrics, use_tracer
from llmrl.trainer import checkpoint as ckpt
from llmrl.trainer.bank import RolloutBank
from llmrl.trainer.distributed import Distributed, tied_duplicates
from llmrl.trainer.lora import ADAPTER_FOLDER, Adapters, adapter_sizes
from llmrl.trainer.memory import GB, LoraSizes, MemoryPlan, MemorySettings, PeakMemory, plan_memory
from llmrl.trainer.optimization import PolicyUpdate, build_optimizer, fast_forward
from llmrl.trainer.plots import plot_curves
from llmrl.trainer.progress import ProgressDisplay
from llmrl.trainer.rollouts import RolloutPipeline, prepare_batch, rollout_metrics, staleness_metrics
from llmrl.trainer.weight_sync import WeightSync, weights_source
from llmrl.types import GenerationArgs


class Trainer:
    """Builds everything a config names, then `run()` trains and returns the summary."""

    def __init__(self, config: RunConfig, *, resume: bool = False, progress_stream: Any = None):
        """
        Args:
            config: the run.
            resume: continue from the run folder's latest checkpoint even if the config changed in
                fields that alter training (the default resumes only an identical config).
            progress_stream: where the progress display writes (default: stdout).
        """
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.progress_stream = progress_stream
        import_plugins(config.plugins)
        transformers.utils.logging.disable_progress_bar()  # per-load and per-save bars would drown ours
        device = _device(config.training.device)
        self.distributed = Distributed.from_env(device)  # None in one process
        self.is_main = self.distributed is None or self.distributed.is_main
        self.inference: InferenceInterface | None = None  # rank 0's alone
        try:
            self._build(config, device, resume)
        except BaseException:
            self._close_inference()
            if self.distributed is not None:  # leave the process group before the interpreter exits
                self.distributed.close(wait=False)
            raise

    def _build(self, config: RunConfig, device: str, resume: bool) -> None:
        self.agents = (
            build_agents(
                config.environments,
                config.seed,
                dynamic_sampling=config.algorithm.dynamic_sampling,
                max_resample_rounds=config.algorithm.max_resample_rounds,
                model_spec=config.model.spec,
            )
            if self.is_main
            else None
        )
        if self.agents is not None:
            self.agents.check_problems()  # a missing dataset column fails here, before models load
        checkpoint = ckpt.checkpoint_to_resume(config, resume)
        torch.manual_seed(config.seed)

        if device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.training.tf32
        # The policy holds the master weights; passes run in the compute dtype (`model.dtype`).
        self.compute_dtype = DTYPES[config.model.dtype]
        self.memory_plan = self._plan_memory(device)
        self.memory_plan.check()  # before any weights load
        self.peak_memory = PeakMemory(device)
        options = {
            "device": device,
            "attn_implementation": config.model.attn_implementation,
            "trust_remote_code": config.model.trust_remote_code,
        }
        distributed = self.distributed

        def load(
            spec: str,
            dtype: str,
            compute_dtype: torch.dtype | None = None,
            prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        ) -> tuple[Any, Any]:
            if distributed is None:
                model, tokenizer = load_model(spec, dtype=dtype, **options)
                return prepare(model) if prepare else model, tokenizer
            # each rank receives its shards of the model rank 0 loads
            return distributed.load_model(
                spec, dtype=dtype, compute_dtype=compute_dtype, prepare=prepare, **options
            )

        self.adapters: Adapters | None = None
        if config.model.lora is None:
            self.policy, self.tokenizer = load(
                str(checkpoint[1] / "model") if checkpoint else config.model.spec,
                config.training.master_dtype,
                self.compute_dtype if config.model.dtype != config.training.master_dtype else None,
            )
            if checkpoint and self.distributed is None:
                ckpt.load_master_weights(checkpoint[1], self.policy)
        else:  # the frozen base in the compute dtype, float32 adapters over it
            lora = config.model.lora

            def with_adapters(base: torch.nn.Module) -> torch.nn.Module:
                # Over several processes the meta-built model's adapters are built last and kept: they
                # are the ones sharded; rank 0's loaded ones reach them with the base weights.
                self.adapters = Adapters(base, lora)
                if checkpoint and not next(base.parameters()).is_meta:
                    self.adapters.load(checkpoint[1] / ADAPTER_FOLDER)
                return self.adapters.model

            # Sharded units cast the float32 adapters to the compute dtype for the passes, as one
            # process's autocast does.
            adapters_cast = self.compute_dtype if self.compute_dtype != torch.float32 else None
            self.policy, self.tokenizer = load(
                config.model.spec, config.model.dtype, adapters_cast, prepare=with_adapters
            )
        if config.training.activation_checkpointing:
            enable_activation_checkpointing(self.policy)
        self.policy.train()
        reference = None
        # Loaded once, never per step; no master copy: it never changes. With LoRA: the policy, adapters off.
        if config.algorithm.kl_beta > 0 and self.adapters is None:
            reference, _ = load(config.model.spec, config.model.dtype)
            reference.eval().requires_grad_(False)
        # Names aliasing another entry (tied embeddings): sent and exported once, under the first name.
        self._tied_names = tied_duplicates(self.policy)
        self.optimizer, self.scheduler = build_optimizer(self.policy, config.training)
        generation = config.inference.generation
        self.generation_args = (
            generation if generation.seed is not None else generation.merge(GenerationArgs(seed=config.seed))
        )
        self.update = PolicyUpdate(
            self.policy,
            self.optimizer,
            algorithm=config.algorithm,
            training=config.training,
            generation_args=generation,
            max_tokens=generation.max_tokens,
            pad_token_id=self.tokenizer.pad_token_id or 0,
            reference=reference,
            reference_context=self.adapters.disabled
            if self.adapters is not None and config.algorithm.kl_beta > 0
            else None,
            distributed=self.distributed,
            compute_dtype=self.compute_dtype,
        )
        if self.is_main:
            self.inference = build_inference(
                config.inference, config.model, seed=config.seed, run_dir=self.run_dir
            )
        source = weights_source(
            self.policy,
            adapters=self.adapters,
            distributed=self.distributed,
            tied_names=self._tied_names,
            bucket_bytes=config.inference.weight_sync_bucket_mb << 20,
            compute_dtype=self.compute_dtype,
        )
        self.weight_sync = WeightSync(source, self.inference)

        self.pipeline: RolloutPipeline | None = None
        self.step = 0
        self.seconds = 0.0  # training wall time over all sessions of this run
        self.evaluations: dict[int, Summary] = {}
        if checkpoint:
            self._restore(checkpoint[1])
        elif self.is_main:
            ckpt.clear_run_outputs(self.run_dir)
        # The inference side may hold other weights (a server kept from an earlier run, or ahead of
        # this checkpoint after a crash): it serves this policy, as this run's version, from the start.
        self.weight_sync.sync(self.step, reset=True)
        self.resumed = checkpoint is not None

    def _plan_memory(self, device: str) -> MemoryPlan:
        config = self.config
        settings = MemorySettings(
            master_dtype=DTYPES[config.training.master_dtype],
            compute_dtype=self.compute_dtype,
            world_size=1 if self.distributed is None else self.distributed.world_size,
            micro_batch_tokens=config.training.micro_batch_tokens,
            row_tokens=config.training.pack_row_tokens,
            activation_checkpointing=config.training.activation_checkpointing,
            reference_model=config.algorithm.kl_beta > 0 and config.model.lora is None,
            engine_tokens=config.inference.max_batch_tokens if config.inference.type == "local" else None,
        )

        def shapes() -> torch.nn.Module:
            model, _ = load_model(
                config.model.spec, device="meta", trust_remote_code=config.model.trust_remote_code
            )
            return model

        if config.model.lora is not None:
            settings = dataclasses.replace(
                settings, lora=LoraSizes(*adapter_sizes(shapes(), config.model.lora))
            )
        return plan_memory(shapes(), settings, device)

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train to `training.steps`; returns the summary also written to ``summary.json``."""
        config, steps = self.config, self.config.training.steps
        with ExitStack() as stack:
            if self.distributed is not None:  # leaves the process group last, whatever happens
                stack.push(self._leave_process_group)
            stack.callback(self._close_inference)  # managed servers stop on every exit
            if config.training.deterministic:
                stack.enter_context(_deterministic_algorithms())
            self._open_outputs(stack)
            if self.step == 0 and config.evaluation.at_start and 0 not in self.evaluations:
                self._log(0, self._evaluate(0))
            display = stack.enter_context(
                ProgressDisplay(
                    steps,
                    start_step=min(self.step, steps),
                    mode=config.logging.progress if self.is_main else "off",
                    stream=self.progress_stream,
                )
            )
            display.message(self.memory_plan.render())
            if self.adapters is not None:
                display.message(self.adapters.summary())
            # Under torchrun every Ctrl-C reaches a worker twice (from the terminal, then forwarded by
            # torchrun).
            stop_requested = self._agreed(
                stack.enter_context(
                    _stop_after_step_on_interrupt(display, second_stops_at_once=self.distributed is None)
                )
            )
            if self.is_main:
                self.pipeline = stack.enter_context(contextlib.closing(self._pipeline()))
                banked = self.pipeline.start(self.step)
                if banked:
                    display.message(f"training first on {banked} batch(es) generated before the interruption")
            while self.step < steps:
                metrics = self._train_step(self.step + 1)
                self.step += 1
                if self._due(config.evaluation.every) or (self.step == steps and config.evaluation.at_end):
                    metrics |= self._evaluate(self.step)
                    display.message(_evaluation_line(self.step, self.evaluations[self.step]))
                self._log(self.step, metrics)
                display.update(self.step, metrics)
                stop = stop_requested()
                if self._due(config.checkpoint.every) or self.step == steps or stop:
                    self._save()
                if stop:
                    display.message(f"stopped after step {self.step}; running the same command again resumes")
                    raise KeyboardInterrupt
                if self.pipeline is not None:
                    self.pipeline.submit_ahead(self.step)  # the batches these weights are to generate
            if config.evaluation.at_end and self.step not in self.evaluations:  # e.g. steps: 0
                self._log(self.step, self._evaluate(self.step))
                self._save()
            return self._finish()

    def _leave_process_group(self, error_type: type[BaseException] | None, *_: Any) -> None:
        # After an error the other ranks may never get to a barrier: only a clean finish waits for them.
        assert self.distributed is not None
        self.distributed.close(wait=error_type is None)

    def _agreed(self, requested: Callable[[], bool]) -> Callable[[], bool]:
        """Over several processes, a stop asked for on any rank (each sees its own Ctrl-C) is agreed
        on by all at the same step, so that they save and stop together."""
        if self.distributed is None:
            return requested
        distributed = self.distributed
        return lambda: distributed.any(requested())

    def _pipeline(self) -> RolloutPipeline:
        training = self.config.training

        def generation_args(step: int) -> GenerationArgs:
            return self.generation_args.merge(
                GenerationArgs(seed=derive_seed(self.generation_args.seed, "step", step))
            )

        return RolloutPipeline(
            self.agents,
            self.inference,
            num_groups=training.prompts_per_step,
            group_size=training.group_size,
            generation_args=generation_args,
            lag=training.generation_lag,
            last_step=training.steps,
            bank=RolloutBank(self.run_dir),
            max_inference_failure_frac=training.max_inference_failure_frac,
        )

    def _train_step(self, step: int) -> dict[str, float]:
        training, started = self.config.training, time.perf_counter()
        with self.tracer.span("rollouts", step=step):  # waiting for generation + reward
            groups = self.pipeline.get(step) if self.pipeline is not None else None
            if self.distributed is not None:
                groups = self.distributed.broadcast_object(groups)
        batch, advantages = prepare_batch(
            groups,
            group_size=training.group_size,
            algorithm=self.config.algorithm,
            max_tokens=self.generation_args.max_tokens,
        )
        with self.tracer.span("train", step=step, sequences=len(batch)):  # logprobs, loss, optimizer
            learning_rate = self.scheduler.get_last_lr()[0]
            update = self.update(
                batch, torch.Generator().manual_seed(derive_seed(self.config.seed, "order", step))
            )
            self.scheduler.step()
        with self.tracer.span("sync", step=step):
            if (
                self.pipeline is not None
            ):  # batches generating now must finish on the weights they started with
                self.pipeline.wait_ahead()
            self.weight_sync.sync(step)
        step_seconds = time.perf_counter() - started
        self.seconds += step_seconds
        peaks = [self.peak_memory.take()]
        if self.distributed is not None:
            peaks = self.distributed.all_gather_object(peaks[0])
        if not self.is_main:
            return {}
        self._log_rollouts(step, groups, advantages)
        generated = sum(r.num_generated for g in groups for r in g.rollouts if r.is_valid)
        metrics = rollout_metrics(
            groups, advantages, correct_threshold=self.config.evaluation.correct_threshold
        )
        metrics |= staleness_metrics(groups, trained_version=step - 1)
        metrics |= {f"train/{key}": value for key, value in update.items()}
        metrics |= {
            "sync/bytes": float(self.weight_sync.bytes_sent),
            "train/lr": learning_rate,
            "train/kl": update.get("ref_kl", update.get("approx_kl", 0.0)),
        }
        metrics |= {f"agents/{key}": value for key, value in self.agents.pop_metrics().items()}
        memory = {"memory/peak_gb": max(peaks), "memory/plan_gb": self.memory_plan.total() / GB}
        if len(peaks) > 1:
            memory["memory/peak_gb_rank0"] = peaks[0]
        return metrics | memory | {"time/step_s": step_seconds, "perf/tokens_per_s": generated / step_seconds}

    def _close_inference(self) -> None:
        if self.inference is not None:
            self.inference.close()

    def _untied(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`weights` without the names that alias another entry (tied embeddings)."""
        return {name: value for name, value in weights.items() if name not in self._tied_names}

    # -- evaluation, logging, checkpoints --------------------------------------------------------

    def _evaluate(self, step: int) -> dict[str, float]:
        if not self.is_main:  # rank 0 evaluates; the others wait for its next broadcast
            self.evaluations[step] = {}
            return {}
        with self.tracer.span("evaluate", step=step):
            # The same seed at every evaluation: differences between steps come from the weights.
            args = self.generation_args.merge(
                GenerationArgs(seed=derive_seed(self.generation_args.seed, "evaluation"))
            )
            summary = run_sync(
                evaluate_environments(self.agents, self.inference, self.config.evaluation, args)
            )
        self.evaluations[step] = summary
        return {
            f"eval/{env}/{name}": value for env, metrics in summary.items() for name, value in metrics.items()
        }

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        """Write one step's line, with the seconds spent in each traced phase since the last line."""
        if not self.is_main:
            return
        phases = self.tracer.durations(reset=True)
        self.metrics_logger.log(
            step, metrics | {f"time/{name}_s": seconds for name, seconds in phases.items()}
        )

    def _log_rollouts(self, step: int, groups: list[Any], advantages: torch.Tensor) -> None:
        rollouts = [r for g in groups for r in g.rollouts]
        count = min(self.config.logging.rollouts_per_step, len(rollouts))
        for k in range(count):  # spread over the step's groups
            index = k * len(rollouts) // count
            self.rollout_log.log(step, rollouts[index], advantage=float(advantages[index]))

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def _state(self, optimizer: dict[str, Any] | None = None) -> dict[str, Any]:
        """Rank 0's trainer state; `optimizer`: the optimizer's entries when they were gathered
        from every rank (`_save_adapters`), else they are this process's."""
        state: dict[str, Any] = {
            "step": self.step,
            "seconds": self.seconds,
            "evaluations": self.evaluations,
            "agents": self.pipeline.agent_state(self.step) if self.pipeline else self.agents.state_dict(),
            "rng": ckpt.rng_state(),
        }
        if optimizer is not None:
            state |= optimizer
        elif self.config.checkpoint.save_optimizer and self.distributed is None:
            state |= {"optimizer": self.optimizer.state_dict()}
        elif self.config.checkpoint.save_optimizer:  # the optimizer goes to the sharded state
            state |= {"sharded_optimizer": True}
        return state

    def _save(self) -> None:
        with self.tracer.span("checkpoint", step=self.step):
            if self.adapters is not None:  # the adapter alone: the base is model.spec
                self._save_adapters()
            elif self.distributed is None:
                ckpt.save_checkpoint(
                    self.run_dir,
                    self.step,
                    model=self.policy,
                    tokenizer=self.tokenizer,
                    trainer_state=self._state(),
                    config_yaml=dump_config(self.config),
                    keep_last=self.config.checkpoint.keep_last,
                    model_state=self._untied(self.policy.state_dict()),
                    dtype=self.compute_dtype,
                )
            else:
                self._save_sharded()
        if self.is_main:
            self.tracer.save()  # rewrites the whole file: at checkpoints, not every step
            RolloutBank(self.run_dir).compact(self.step)

    def _save_adapters(self) -> None:
        """A LoRA checkpoint, the same from any number of processes: the adapters and their optimizer
        state, gathered whole on every rank (small), written by rank 0."""
        adapters = self.adapters.weights()
        optimizer: dict[str, Any] = {}
        if self.config.checkpoint.save_optimizer:
            optimizer["optimizer"] = (
                self.optimizer.state_dict()
                if self.distributed is None
                else ckpt.gathered_optimizer_state(self.policy, self.optimizer)
            )
        if self.is_main:
            temp = ckpt.start_checkpoint(self.run_dir, self.step)
            adapters.save(temp / ADAPTER_FOLDER)
            ckpt.write_run_state(
                temp, trainer_state=self._state(optimizer), config_yaml=dump_config(self.config)
            )
            ckpt.finish_checkpoint(self.run_dir, self.step, temp, keep_last=self.config.checkpoint.keep_last)
        if self.distributed is not None:
            self.distributed.barrier()  # nobody goes on (or resumes) before the checkpoint is in place

    def _save_sharded(self) -> None:
        """The checkpoint of a multi-process run: every rank writes its shards of the model and
        optimizer; rank 0 writes the Hugging Face folder (gathered weights), the rest, and renames."""
        distributed = self.distributed
        assert distributed is not None
        weights: dict[
            str, torch.Tensor
        ] = {}  # in the compute dtype the folder is written in: no float32 copy
        for bucket in distributed.gathered_buckets(
            self.policy,
            self.config.inference.weight_sync_bucket_mb << 20,
            skip=self._tied_names,
            dtype=self.compute_dtype,
        ):
            weights |= bucket
        temp = distributed.broadcast_object(
            ckpt.start_checkpoint(self.run_dir, self.step) if self.is_main else None
        )
        ckpt.save_sharded(
            temp, self.policy, self.optimizer if self.config.checkpoint.save_optimizer else None
        )
        if self.is_main:
            ckpt.write_checkpoint_files(
                temp,
                model=self.policy,
                tokenizer=self.tokenizer,
                trainer_state=self._state(),
                config_yaml=dump_config(self.config),
                model_state=weights,
                dtype=self.compute_dtype,
            )
            ckpt.finish_checkpoint(self.run_dir, self.step, temp, keep_last=self.config.checkpoint.keep_last)
        distributed.barrier()  # nobody goes on (or resumes) before the checkpoint is in place

    def _restore(self, folder: Path) -> None:
        state = ckpt.load_trainer_state(folder)
        self.step, self.seconds, self.evaluations = state["step"], state["seconds"], state["evaluations"]
        if self.agents is not None:
            self.agents.load_state_dict(state["agents"])
        ckpt.set_rng_state(state["rng"])
        sharded = self.distributed is not None
        ckpt.load_optimizer(
            folder, state, self.policy, self.optimizer, sharded_model=sharded
        )  # else Adam starts over
        # The schedule is a function of the step: stepped as often as the uninterrupted run stepped it,
        # it gives the same rates bit for bit, from checkpoints of any version of llmrl.
        fast_forward(self.scheduler, self.step)

    def _open_outputs(self, stack: ExitStack) -> None:
        if not self.is_main:  # the other ranks only keep their phase times
            self.tracer = Tracer(self.run_dir / "trace.json", enabled=False)
            stack.enter_context(use_tracer(self.tracer))
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.config))
        resume_step = self.step if self.resumed else None
        logging = self.config.logging
        self.metrics_logger = stack.enter_context(
            MetricsLogger(
                self.run_dir,
                tensorboard=logging.tensorboard,
                wandb=logging.wandb,
                wandb_project=logging.wandb_project,
                wandb_mode=logging.wandb_mode,
                config=self.config.model_dump(mode="json"),
                resume_step=resume_step,
            )
        )
        self.rollout_log = stack.enter_context(
            RolloutLog(self.run_dir / "rollouts.jsonl", resume_step=resume_step)
        )
        self.tracer = Tracer(self.run_dir / "trace.json", enabled=logging.trace)
        stack.callback(self.tracer.save)
        stack.enter_context(use_tracer(self.tracer))

    def _finish(self) -> dict[str, Any]:
        last = max(self.evaluations, default=None)
        summary = {
            "eval_start": self.evaluations.get(0, {}),
            "eval_end": self.evaluations[last] if last is not None and last == self.step else {},
            "steps": self.step,
            "seconds": round(self.seconds, 3),
        }
        if not self.is_main:
            return summary
        atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        plot_curves(
            read_metrics(self.run_dir / "metrics.jsonl"),
            self.run_dir / "curves.png",
            title=f"{self.config.model.spec} on {', '.join(e.name for e in self.config.environments)}",
        )
        return summary


# -- helpers ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _stop_after_step_on_interrupt(
    display: ProgressDisplay, *, second_stops_at_once: bool = True
) -> Iterator[Callable[[], bool]]:
    """Turn the first Ctrl-C into "finish this step, save, stop"; a second one stops at once (unless
    `second_stops_at_once` is False: then torchrun's kill after its grace period is the hard stop).

    Yields the function that says whether a stop was asked for. Off the main thread (where Python
    delivers signals) Ctrl-C keeps its usual effect.
    """
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested.is_set
        return

    def on_interrupt(signum: int, frame: Any) -> None:
        if requested.is_set():
            if second_stops_at_once:
                raise KeyboardInterrupt
            return
        requested.set()
        again = " (Ctrl-C again stops at once)" if second_stops_at_once else ""
        display.message(f"Ctrl-C: stopping after this step and saving a checkpoint{again}")

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield requested.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _deterministic_algorithms() -> Iterator[None]:
    """Deterministic torch kernels for the run; the process-wide setting is restored afterwards."""
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device: 'cuda' was asked for but no CUDA device is available")
    return choice


def _evaluation_line(step: int, summary: Summary) -> str:
    parts = []
    for env, metrics in summary.items():
        shown = ", ".join(
            f"{name} {metrics[name]:.3f}" for name in ("pass@1", "greedy_accuracy") if name in metrics
        )
        parts.append(f"{env}: {shown}")
    return f"evaluation at step {step}: " + "; ".join(parts)
