"""What a run writes besides its model: checkpoints (`CheckpointConfig`) and metrics, logs and traces
(`LoggingConfig`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from llmrl.config.sections import Section


class CheckpointConfig(Section):
    every: int = Field(20, ge=0)
    """Save every N steps (0 = only at the end)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted."""
    save_optimizer: bool = True
    """Include optimizer and scheduler state (needed for exact resume)."""
    on_signal: Literal["finish_step", "save_now"] = "finish_step"
    """What SIGTERM, SIGINT (Ctrl-C) or SIGHUP does: `finish_step` finishes the step in flight, then saves
    it; `save_now`, for schedulers that allow little time before they kill, abandons the step while it
    still waits for its rollouts and saves the last finished one (a step already updating the weights
    finishes first). Either way the run stops with exit status 128 + the signal's number (143 for
    SIGTERM), and the same command resumes it, ending as an uninterrupted run would."""


class LoggingConfig(Section):
    tensorboard: bool = True
    """Write TensorBoard event files to the run folder."""
    wandb: bool = False
    """Log to Weights & Biases (needs the `wandb` extra)."""
    wandb_project: str = "llmrl"
    """W&B project name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """W&B mode; offline writes locally and can be synced later, disabled makes every call a no-op."""
    rollouts_per_step: int = Field(8, ge=0)
    """Rollouts written to rollouts.jsonl per step (text, reward)."""
    trace: bool = True
    """Record a Chrome-trace/Perfetto timeline of the run's phases."""
    progress: Literal["auto", "rich", "plain", "off"] = "auto"
    """Progress display: a rich bar on a terminal, plain lines otherwise."""

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false
