"""The RL loop: collect rollouts, compute advantages and the loss, update, sync weights, evaluate, save.

`Trainer(config).run()` is the whole of ``llmrl train``. One step::

    groups   = rollouts.get(step)          the agents' groups, generated + rewarded (llmrl.rollouts)
    batch    = prepare_batch(groups)       shaping, advantages
    metrics  = update(batch)               logprobs, the loss terms, AdamW
    weight_sync.sync(step)                 the engine serves them

with evaluation at the start, every `evaluation.every` steps and at the end, and a checkpoint every
`checkpoint.every` steps and at the end. A run folder that already holds a checkpoint of the same
config is resumed from it; see `llmrl.trainer.checkpoint` for what is saved. A run holds its folder
while it trains, so that a second one into it stops at once, and stops with one line, its last
checkpoint intact, when the folder cannot be written (`llmrl.trainer.run_folder`). SIGINT, SIGTERM and
SIGHUP stop it after a checkpoint (`_stop_on_signals`, `llmrl.stopping`). Resumed runs end with
the same weights as uninterrupted ones: every random choice is derived from `config.seed` and the
step (generation seeds per request, mini-batch order), and the rest of the state is checkpointed.

Under ``torchrun`` (more than one process) the policy is sharded over the processes
(`llmrl.trainer.distributed`): rank 0 alone generates, evaluates and writes the run folder, and
broadcasts each step's rollouts; every rank trains on its share of the batch.

A run has three modes (one process; FSDP2 shards over several; LoRA adapters, over any number),
and the loop does not branch on them: the parts it builds once from the config know the mode and
what their rank does. `llmrl.trainer.policy` loads the policy and its KL reference,
`llmrl.trainer.weight_sync` serves the weights to inference, `llmrl.trainer.checkpointer` saves and
restores, `llmrl.trainer.evaluator` evaluates and `llmrl.trainer.outputs` writes the run folder.
`llmrl.rollouts` gives each step's rollout groups (`RolloutSource`: rank 0's pipeline, or on the
other ranks what rank 0 broadcasts). What stays here is the order of things, and what only rank 0
has: the agents and the inference side.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import transformers

from llmrl.agents import PromptRoom, WeightedMultiTask, build_agents
from llmrl.config import ConfigError, InferenceConfig, RunConfig
from llmrl.errors import ModelSpecError, UserError
from llmrl.files import os_error_behind
from llmrl.inference import InferenceInterface, build_inference
from llmrl.inference.interface import InferenceUnavailableError
from llmrl.inference.kv_cache import max_positions
from llmrl.inference.managed_server import ManagedModelServer, start_model_server
from llmrl.inference.prompts import overlong_prompts
from llmrl.inference.served_teacher import check_served_tokenizer
from llmrl.models.routing import moe_routers
from llmrl.processes import ServerStartError
from llmrl.registry import import_plugins
from llmrl.rollouts import RolloutSource, prepare_batch, rollout_metrics, rollout_source, staleness_metrics
from llmrl.seeding import derive_seed
from llmrl.stopping import STOP_SIGNALS, StepAbandoned, StoppedBySignal, stop_abandons_steps
from llmrl.threads import set_torch_threads
from llmrl.trainer import checkpoint as ckpt
from llmrl.trainer.checkpointer import checkpointer_for, resume_point
from llmrl.trainer.distributed import Distributed, OneProcess
from llmrl.trainer.evaluated_model import with_model_folder
from llmrl.trainer.evaluator import Evaluator
from llmrl.trainer.memory import GB, PeakMemory
from llmrl.trainer.optimization import PolicyUpdate, build_optimizer, fast_forward
from llmrl.trainer.outputs import RunOutputs, SilentOutputs
from llmrl.trainer.policy import load_policy, plan_training_memory
from llmrl.trainer.progress import ProgressDisplay
from llmrl.trainer.run_folder import RunFolderWriteError, RunLock, write_failure
from llmrl.trainer.weight_sync import WeightSync, weights_source
from llmrl.types import GenerationArgs, RolloutGroup


class AlreadyTrainedError(Exception):
    """The run folder's checkpoint is past `training.steps`: there is nothing to train (not an error of
    the run; the CLI says so and exits with status 0)."""


_DISK_REFUSALS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
"""The OS errors of a write that the file system refused (full, over quota, read-only): a run stops on
them with one line wherever they occur (`write_failure`)."""


class Trainer:
    """Builds everything a config names, then `run()` trains and returns the summary."""

    rollouts: RolloutSource
    """This rank's source of each step's rollout groups (`llmrl.rollouts`), from the start of `run`."""

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
        self.threads = set_torch_threads(cuda=device == "cuda")  # before any thread computes
        self.distributed = Distributed.from_env(device)  # None in one process: the parts built know the mode
        self.processes = self.distributed or OneProcess()  # the loop's collectives, whatever the mode
        self.is_main = self.processes.is_main
        self.inference: InferenceInterface | None = None  # rank 0's, or every process's colocated engine
        self.run_lock: RunLock | None = None  # rank 0's alone
        # Rank 0's, with distillation.teacher_server.serve.
        self.teacher_server: ManagedModelServer | None = None
        try:
            self.run_lock = self._hold_run_dir()
            config = self.config = self._with_model_folder(config)
            self._build(config, device, resume)
        except BaseException:
            self._close_inference()
            self._stop_teacher_server()
            self._release_run_dir()
            self.processes.close(wait=False)  # leave the process group before the interpreter exits
            raise

    def _hold_run_dir(self) -> RunLock | None:
        """Rank 0's hold on the run folder (`llmrl.trainer.run_folder`); when another run trains there,
        or it cannot be written, every rank stops."""
        lock, refusal = None, None
        if self.is_main:
            try:
                lock = RunLock(self.run_dir)
            except UserError as exc:
                refusal = exc
        refusal = self.processes.broadcast_object(refusal)
        if refusal is not None:
            raise refusal
        return lock

    def _with_model_folder(self, config: RunConfig) -> RunConfig:
        """A run or checkpoint folder as model.spec stands for its model folder, pinned for the resumes; a
        LoRA one for its adapter merged into this run's folder. Rank 0 resolves (and merges) it for all."""
        spec: str | UserError | None = None
        if self.is_main:
            try:
                spec = with_model_folder(config, merge_lora=True).model.spec
            except UserError as refusal:
                spec = refusal
        spec = self.processes.broadcast_object(spec)
        if isinstance(spec, UserError):
            raise spec
        return config.model_copy(update={"model": config.model.model_copy(update={"spec": spec})})

    def _with_teacher_server(self, config: RunConfig) -> RunConfig:
        """`config` with a `distillation.teacher_server.serve` started and named by its `url`: one server,
        which rank 0 starts and alone asks (`ServedTeacherScores`), logging to `RUN_DIR/teacher_server/`."""
        served = config.distillation.teacher_server if config.distillation is not None else None
        if served is None or served.serve is None:
            return config
        assert config.distillation is not None
        url: str | Exception | None = None
        if self.is_main:
            try:
                self.teacher_server = start_model_server(
                    served.serve,
                    log_path=self.run_dir / "teacher_server" / "server.log",
                    seed=config.seed,
                    field="distillation.teacher_server.serve",
                    max_logprobs=config.distillation.top_k,
                )
                url = self.teacher_server.base_url
            except (UserError, ServerStartError) as refusal:
                url = refusal
        url = self.processes.broadcast_object(url)
        if isinstance(url, Exception):
            raise url
        started = served.model_copy(update={"url": url, "serve": None})
        distillation = config.distillation.model_copy(update={"teacher_server": started})
        return config.model_copy(update={"distillation": distillation})

    def _check_teacher_tokenizer(self, config: RunConfig) -> None:
        """Rank 0 asks a served teacher whether its tokenizer is the policy's; every rank stops if not."""
        served = self.models.teacher_server
        if served is None:
            return
        assert config.distillation is not None and config.distillation.teacher_server is not None
        serve = config.distillation.teacher_server.serve
        refusal: Exception | None = None
        if self.is_main:
            try:
                check_served_tokenizer(
                    served,
                    self.models.tokenizer,
                    teacher=serve.model if serve is not None else f"at {served.base_url}",
                    policy=config.model.spec,
                )
            except (UserError, InferenceUnavailableError) as exc:
                refusal = exc
        refusal = self.processes.broadcast_object(refusal)
        if refusal is not None:
            raise refusal

    def _check_router_replay(self, config: RunConfig) -> None:
        """Router replay needs an MoE policy whose gating it can replay."""
        if not config.training.router_replay:
            return
        try:
            moe_routers(self.policy)
        except ModelSpecError as exc:
            raise ConfigError(f"training.router_replay: {config.model.spec}: {exc}") from None

    def _stop_teacher_server(self) -> None:
        if self.teacher_server is not None:
            self.teacher_server.close()

    def _inference_config(self, config: RunConfig) -> InferenceConfig:
        """The inference section this run builds, with the embedded engine as the memory plan sized it."""
        inference = config.inference_for_run()
        plan = self.memory_plan
        if plan.engine_sizing is None:
            return inference
        return inference.model_copy(
            update={
                "max_batch_tokens": plan.settings.engine_tokens,
                "max_concurrent": plan.engine_sizing.rows,
            }
        )

    def _release_run_dir(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()

    def _build(self, config: RunConfig, device: str, resume: bool) -> None:
        checkpoint = resume_point(config, resume, self.processes)
        if checkpoint and checkpoint[0] > config.training.steps:
            raise AlreadyTrainedError(
                f"{config.run_dir} already ran {checkpoint[0]} steps (training.steps={config.training.steps}): "
                "nothing to train; raise training.steps to continue"
            )
        self.agents = self._agents() if self.is_main else None  # rank 0 generates
        torch.manual_seed(config.seed)
        if device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.training.tf32
        self.memory_plan = plan_training_memory(config, device, self.distributed)
        self.memory_plan.check()  # before any weights load
        self.peak_memory = PeakMemory(device)
        checkpoint_folder = checkpoint[1] if checkpoint else None
        self.models = load_policy(
            self._with_teacher_server(config), device, self.distributed, checkpoint_folder
        )
        self._check_teacher_tokenizer(config)
        self.policy = self.models.policy
        self._check_router_replay(config)
        self.optimizer, self.scheduler = build_optimizer(self.policy, config.training)
        generation = config.inference.generation
        self.generation_args = (
            generation if generation.seed is not None else generation.merge(GenerationArgs(seed=config.seed))
        )
        if self.agents is not None:  # before any problem is drawn, or the problem order restored
            self.agents.drop_overlong_prompts(self._prompt_room(config), self.generation_args)
        self.update = self._policy_update()
        if self.is_main or config.inference.in_every_process:
            self.inference = build_inference(
                self._inference_config(config), config.model, seed=config.seed, run_dir=self.run_dir
            )
        source = weights_source(
            self.policy,
            adapters=self.models.adapters,
            distributed=self.distributed,
            tied_names=self.models.tied_names,
            bucket_bytes=config.inference.weight_sync_bucket_mb << 20,
            compute_dtype=self.models.compute_dtype,
        )
        self.weight_sync = WeightSync(source, self.inference)
        self.checkpointer = checkpointer_for(config, self.models, self.optimizer, self.distributed)
        self.evaluator = Evaluator(self.agents, config.evaluation, self.generation_args)
        self.outputs = RunOutputs(config) if self.is_main else SilentOutputs(config)

        self.step = 0
        self.seconds = 0.0  # training wall time over all sessions of this run
        if checkpoint:
            self._restore(checkpoint[1])
        else:
            self.outputs.clear()
        self.saved_step = self.step  # the run folder holds this step's state: a new run's is its start
        # The inference side may hold other weights (a server kept from an earlier run, or ahead of
        # this checkpoint after a crash): it serves this policy, as this run's version, from the start.
        self.weight_sync.sync(self.step, reset=True)
        self.resumed = checkpoint is not None

    def _agents(self) -> WeightedMultiTask:
        config = self.config
        agents = build_agents(
            config.environments,
            config.seed,
            dynamic_sampling=config.algorithm.dynamic_sampling,
            max_resample_rounds=config.algorithm.max_resample_rounds,
            model_spec=config.model.spec,
        )
        agents.check_problems()  # a missing dataset column fails here, before models load
        return agents

    def _prompt_room(self, config: RunConfig) -> PromptRoom:
        """The room for prompts in the context of the model that generates: vLLM's `max_model_len` where
        set, else the model's own."""
        vllm_limit = config.inference.vllm.max_model_len if config.inference.type == "vllm" else None
        return PromptRoom(
            context=vllm_limit or max_positions(self.models.policy.config),
            overlong=functools.partial(overlong_prompts, self.models.tokenizer),
            refuse=config.training.overlong_prompts == "refuse",
        )

    def _policy_update(self) -> PolicyUpdate:
        config, models = self.config, self.models
        generation = config.inference.generation
        return PolicyUpdate(
            self.policy,
            self.optimizer,
            algorithm=config.algorithm,
            training=config.training,
            generation_args=generation,
            max_tokens=generation.max_tokens,
            pad_token_id=models.tokenizer.pad_token_id or 0,
            reference=models.reference,
            reference_context=models.reference_context,
            distributed=self.distributed,
            compute_dtype=models.compute_dtype,
            teacher=models.teacher,
            teacher_server=models.teacher_server,
            distillation=config.distillation,
            logits_chunk_tokens=self.memory_plan.logits_chunk_tokens,
        )

    def _restore(self, folder: Path) -> None:
        state = self.checkpointer.restore(folder)
        self.step, self.seconds = state["step"], state["seconds"]
        self.evaluator.evaluations = state["evaluations"]
        if self.agents is not None:
            self.agents.load_state_dict(state["agents"])
        # The schedule is a function of the step: stepped as often as the uninterrupted run stepped it,
        # it gives the same rates bit for bit, from checkpoints of any version of llmrl.
        fast_forward(self.scheduler, self.step)

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train to `training.steps`; returns the summary also written to ``summary.json``."""
        try:
            return self._run()
        except Exception as exc:
            error = os_error_behind(exc)
            if isinstance(exc, RunFolderWriteError) or error is None or error.errno not in _DISK_REFUSALS:
                raise
            raise write_failure(error.filename or str(self.run_dir), error, self.run_dir) from exc

    def _run(self) -> dict[str, Any]:
        steps = self.config.training.steps
        with ExitStack() as stack:
            display, stop_requested = self._start(stack)
            while self.step < steps:
                metrics = self._train_or_abandon_step(display)
                self.step += 1
                if self.evaluator.due_after(self.step, steps):
                    metrics |= self.evaluator.evaluate(self.step, self.inference)
                    display.message(self.evaluator.line(self.step))
                self.outputs.log(self.step, metrics)
                display.update(self.step, metrics)
                stop_signal = stop_requested()
                if self.checkpointer.due(self.step, steps) or stop_signal:
                    self._save()
                if stop_signal:
                    display.message(_stopped_after(self.step))
                    raise StoppedBySignal(stop_signal)
                self.rollouts.submit_ahead(self.step)  # the batches these weights are to generate
            if self.evaluator.missing_at_end(self.step):  # e.g. steps: 0
                self.outputs.log(self.step, self.evaluator.evaluate(self.step, self.inference))
                self._save()
            self.processes.barrier()  # rank 0's last evaluation may use other processes' engines
            return self._finish()

    def _start(self, stack: ExitStack) -> tuple[ProgressDisplay, Callable[[], int]]:
        """What the run holds until it ends, onto `stack`; returns the progress display and the
        function that gives the signal that asked for a stop (0 while none did)."""
        config, steps = self.config, self.config.training.steps
        stack.push(self._leave_process_group)  # last, whatever happens
        stack.callback(self._release_run_dir)  # once nothing writes the run folder any more
        stack.callback(self._close_inference)  # managed servers stop on every exit
        stack.callback(self._stop_teacher_server)
        if config.training.deterministic:
            stack.enter_context(_deterministic_algorithms())
        self.outputs.open(stack, resume_step=self.step if self.resumed else None)
        display = stack.enter_context(
            ProgressDisplay(
                steps,
                start_step=min(self.step, steps),
                mode=self.outputs.progress_mode,
                stream=self.progress_stream,
            )
        )
        display.message(self.memory_plan.render())
        display.message(self.threads.describe())
        if self.models.adapters is not None:
            display.message(self.models.adapters.summary())
        if self.evaluator.due_at_start(self.step):
            self.outputs.log(0, self.evaluator.evaluate(0, self.inference))
            display.message(self.evaluator.line(0))
        stop_requested = self._stop_requests(stack, display)
        self.rollouts = stack.enter_context(
            contextlib.closing(
                rollout_source(config, self.processes, self.agents, self.inference, self.generation_args)
            )
        )
        banked = self.rollouts.start(self.step)
        if banked:
            display.message(f"training first on {banked} batch(es) generated before the interruption")
        return display, stop_requested

    def _leave_process_group(self, error_type: type[BaseException] | None, *_: Any) -> None:
        # After an error the other ranks may never get to a barrier: only a clean finish, or a stop every
        # rank agreed on at the same step, waits for them.
        agreed = error_type is None or issubclass(error_type, StoppedBySignal)
        self.processes.close(wait=agreed)

    def _stop_requests(self, stack: ExitStack, display: ProgressDisplay) -> Callable[[], int]:
        """The function that gives the signal that asked for a stop (SIGINT, SIGTERM, SIGHUP), 0 while
        none did. Over several processes, a signal on any rank is agreed on by all at the same step (the
        largest signal number, if ranks saw different ones), so that they save and stop together: torchrun
        forwards each signal to every worker, and a terminal's Ctrl-C reaches a worker twice (from the
        terminal, then forwarded by torchrun)."""
        processes = self.processes
        received = stack.enter_context(
            _stop_on_signals(
                display,
                save_now=self.config.checkpoint.on_signal == "save_now",
                second_stops_at_once=processes.world_size == 1,
            )
        )
        return lambda: processes.max_count(received())

    def _train_or_abandon_step(self, display: ProgressDisplay) -> dict[str, float]:
        """`_train_step` of the next step. A stop that abandons it (`StepAbandoned`: it still waited for
        its rollouts) saves the last finished step as that step ended, and stops."""
        # The global RNG states as the last step left them: the wait for rollouts may draw from them
        # (an agent's or reward function's `random`), and an abandoned step must leave no trace.
        rng_after_last_step = ckpt.rng_state() if self.config.checkpoint.on_signal == "save_now" else None
        try:
            return self._train_step(self.step + 1)
        except StepAbandoned as abandoned:
            display.message(
                f"{abandoned.name}: step {self.step + 1} abandoned before its update; "
                f"saving a checkpoint of step {self.step}"
            )
            if rng_after_last_step is not None and self.saved_step != self.step:
                ckpt.set_rng_state(rng_after_last_step)
                self._save()
            display.message(_stopped_after(self.step))
            raise StoppedBySignal(abandoned.signum) from None

    def _train_step(self, step: int) -> dict[str, float]:
        training, tracer, started = self.config.training, self.outputs.tracer, time.perf_counter()
        with tracer.span("rollouts", step=step):  # waiting for generation + reward
            groups = self.rollouts.get(step)
        batch, advantages = prepare_batch(
            groups,
            group_size=training.group_size,
            algorithm=self.config.algorithm,
            max_tokens=self.generation_args.max_tokens,
        )
        self.weight_sync.before_update()
        with tracer.span("train", step=step, sequences=len(batch)):  # logprobs, loss, optimizer
            learning_rate = self.scheduler.get_last_lr()[0]
            update = self.update(
                batch, torch.Generator().manual_seed(derive_seed(self.config.seed, "order", step))
            )
            _step_schedule(self.scheduler)
        with tracer.span("sync", step=step):
            # batches generating now must finish on the weights they started with (unless in flight)
            self.rollouts.wait_ahead()
            self.weight_sync.sync(step)
        step_seconds = time.perf_counter() - started
        self.seconds += step_seconds
        peaks = self.processes.all_gather_object(self.peak_memory.take())
        self.outputs.log_rollouts(step, groups, advantages)
        if not self.is_main:  # the agents' counters are rank 0's, and so are the metrics
            return {}
        memory = {"memory/peak_gb": max(peaks), "memory/plan_gb": self.memory_plan.total() / GB}
        if len(peaks) > 1:
            memory["memory/peak_gb_rank0"] = peaks[0]
        generated = sum(r.num_generated for g in groups for r in g.rollouts if r.is_valid)
        return (
            self._step_metrics(step, groups, advantages, update, learning_rate)
            | memory
            | {"time/step_s": step_seconds, "perf/tokens_per_s": generated / step_seconds}
        )

    def _step_metrics(
        self,
        step: int,
        groups: list[RolloutGroup],
        advantages: torch.Tensor,
        update: dict[str, float],
        learning_rate: float,
    ) -> dict[str, float]:
        metrics = rollout_metrics(
            groups, advantages, correct_threshold=self.config.evaluation.correct_threshold
        )
        metrics |= staleness_metrics(groups, trained_version=step - 1)
        metrics |= self.rollouts.pop_metrics()
        # The loss's metrics go under train/; distillation's come named (distill/...).
        metrics |= {
            key if key.startswith("distill/") else f"train/{key}": value for key, value in update.items()
        }
        metrics |= {
            "sync/bytes": float(self.weight_sync.bytes_sent),
            "train/lr": learning_rate,
            "train/kl": update.get("ref_kl", update.get("approx_kl", 0.0)),
        }
        return metrics | {f"agents/{key}": value for key, value in self.agents.pop_metrics().items()}

    def _close_inference(self) -> None:
        if self.inference is not None:
            self.inference.close()

    # -- checkpoints and the end -----------------------------------------------------------------

    def _save(self) -> None:
        with self.outputs.tracer.span("checkpoint", step=self.step):
            self.checkpointer.save(self.step, self._state)
        self.outputs.checkpointed(self.step)
        self.saved_step = self.step

    def _state(self) -> dict[str, Any]:
        """The loop's own state for a checkpoint (the checkpointer adds the RNG and optimizer
        states); asked for on rank 0 alone."""
        return {
            "step": self.step,
            "seconds": self.seconds,
            "evaluations": self.evaluator.evaluations,
            "agents": self.rollouts.agent_state(self.step),
        }

    def _finish(self) -> dict[str, Any]:
        summary = self.evaluator.endpoints(self.step) | {
            "steps": self.step,
            "seconds": round(self.seconds, 3),
        }
        self.outputs.finish(summary)
        return summary


# -- helpers ---------------------------------------------------------------------------------------


def _step_schedule(schedule: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the LR schedule by one RL step. A step with no signal skips its optimizer step by design
    (`PolicyUpdate`), and the schedule is a function of the RL step, so it advances regardless; torch
    warns when that happens on the first step, which here is no mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before", UserWarning)
        schedule.step()


def _stopped_after(step: int) -> str:
    return f"stopped after step {step}; running the same command again resumes"


@contextlib.contextmanager
def _stop_on_signals(
    display: ProgressDisplay, *, save_now: bool, second_stops_at_once: bool = True
) -> Iterator[Callable[[], int]]:
    """Turn the first SIGINT, SIGTERM or SIGHUP into "finish this step, save, stop" (with `save_now`, a
    step still waiting for its rollouts is abandoned instead: `llmrl.stopping`); a second one stops at
    once (unless `second_stops_at_once` is False: then torchrun's kill after its grace period is the
    hard stop).

    Yields the function that gives the signal that asked for a stop, 0 while none did. Off the main
    thread (where Python delivers signals) the signals keep their usual effect.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: 0
        return

    with stop_abandons_steps() as abandon:

        def on_signal(signum: int, frame: Any) -> None:
            if received:
                if second_stops_at_once:
                    raise StoppedBySignal(signum)
                return
            received.append(signum)
            if save_now:
                abandon(signum)  # raises where the step waits for its rollouts, and the loop says so
            name = signal.Signals(signum).name
            again = "Ctrl-C" if signum == signal.SIGINT else name
            hint = f" ({again} again stops at once)" if second_stops_at_once else ""
            # With save_now, a step that has not begun its update is abandoned, and says so in a line of its own.
            when = " (a step that has begun its update finishes first)" if save_now else " after this step"
            display.message(f"{name}: stopping{when} and saving a checkpoint{hint}")

        previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
        try:
            yield lambda: received[0] if received else 0
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


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
