"""Inference interfaces: the embedded engine (`local`) and HTTP clients, built from config by name."""

from __future__ import annotations

from pathlib import Path

from llmrl.config import InferenceConfig, ModelConfig
from llmrl.inference.interface import Health, InferenceInterface, InferenceUnavailableError, run_sync
from llmrl.registry import get_inference_class

__all__ = ["Health", "InferenceInterface", "InferenceUnavailableError", "build_inference", "run_sync"]


def build_inference(
    config: InferenceConfig, model: ModelConfig, *, seed: int, run_dir: str | Path | None = None
) -> InferenceInterface:
    """The interface named by `config.type`, built by its class's `from_config` (managed vLLM
    servers log to the run folder)."""
    cls = get_inference_class(config.type)
    return cls.from_config(config, model, seed=seed, run_dir=Path(run_dir) if run_dir is not None else None)
