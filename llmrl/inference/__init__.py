"""Inference interfaces: the embedded engine (`local`) and HTTP clients, built from config by name."""

from __future__ import annotations

import inspect
from pathlib import Path

from llmrl.config import InferenceConfig, ModelConfig
from llmrl.inference.interface import InferenceInterface, run_sync
from llmrl.registry import get_inference_class

__all__ = ["InferenceInterface", "build_inference", "close_inference", "run_sync"]


def build_inference(
    config: InferenceConfig, model: ModelConfig, *, seed: int, run_dir: str | Path | None = None
) -> InferenceInterface:
    """The interface named by `config.type`; each registered class builds itself with `from_config`
    (given the run folder when it takes `run_dir`: managed vLLM servers log there).

    An interface that holds processes or files has a `close()`; `close_inference` calls it."""
    cls = get_inference_class(config.type)
    if run_dir is not None and "run_dir" in inspect.signature(cls.from_config).parameters:
        return cls.from_config(config, model, seed=seed, run_dir=run_dir)
    return cls.from_config(config, model, seed=seed)


def close_inference(inference: InferenceInterface | None) -> None:
    """Release what `inference` holds (managed servers, weight files), if it holds anything."""
    close = getattr(inference, "close", None)
    if callable(close):
        close()
