"""What a run writes into its folder besides checkpoints: the config, metrics, sampled rollouts, the
trace, and at the end the summary and the curves.

Rank 0 writes them all (`RunOutputs`); over several processes the other ranks get `SilentOutputs`,
whose writes do nothing and whose tracer keeps only phase times, so that the loop writes its outputs
with the same calls on every rank.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from llmrl.config import RunConfig, dump_config
from llmrl.files import atomic_write
from llmrl.rollouts import RolloutBank
from llmrl.telemetry import MetricsLogger, RolloutLog, Tracer, read_metrics, use_tracer
from llmrl.trainer import checkpoint as ckpt
from llmrl.trainer.plots import plot_curves
from llmrl.types import RolloutGroup


class RunOutputs:
    """Rank 0's run folder outputs."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.progress_mode = config.logging.progress
        """The progress display's mode."""
        self.tracer: Tracer

    def clear(self) -> None:
        """A run starting at step 0: the outputs of an earlier, never-checkpointed attempt go."""
        ckpt.clear_run_outputs(self.run_dir)

    def open(self, stack: ExitStack, resume_step: int | None) -> None:
        """Start writing (appending after `resume_step` when the run resumes); `stack` closes them."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.config))
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

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write one step's line, with the seconds spent in each traced phase since the last line."""
        phases = self.tracer.durations(reset=True)
        self.metrics_logger.log(
            step, metrics | {f"time/{name}_s": seconds for name, seconds in phases.items()}
        )

    def log_rollouts(self, step: int, groups: list[RolloutGroup], advantages: torch.Tensor) -> None:
        """A few of the step's rollouts (`logging.rollouts_per_step`), spread over its groups."""
        rollouts = [r for g in groups for r in g.rollouts]
        count = min(self.config.logging.rollouts_per_step, len(rollouts))
        for k in range(count):
            index = k * len(rollouts) // count
            self.rollout_log.log(step, rollouts[index], advantage=float(advantages[index]))

    def checkpointed(self, step: int) -> None:
        """After the checkpoint of `step`: the trace so far is saved (the whole file: at checkpoints,
        not every step), and the banked batches it covers are dropped."""
        self.tracer.save()
        RolloutBank(self.run_dir).compact(step)

    def finish(self, summary: dict[str, Any]) -> None:
        """The run's summary and its curves."""
        atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        plot_curves(
            read_metrics(self.run_dir / "metrics.jsonl"),
            self.run_dir / "curves.png",
            title=f"{self.config.model.spec} on {', '.join(e.name for e in self.config.environments)}",
        )


class SilentOutputs(RunOutputs):
    """The outputs of a rank other than 0: nothing is written; the tracer keeps the phase times."""

    def __init__(self, config: RunConfig):
        super().__init__(config)
        self.progress_mode = "off"

    def clear(self) -> None:
        pass

    def open(self, stack: ExitStack, resume_step: int | None) -> None:
        self.tracer = Tracer(self.run_dir / "trace.json", enabled=False)
        stack.enter_context(use_tracer(self.tracer))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_rollouts(self, step: int, groups: list[RolloutGroup], advantages: torch.Tensor) -> None:
        pass

    def checkpointed(self, step: int) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass
