"""Inference interfaces: the embedded engine (`local`) and HTTP clients, built from config by name."""

from __future__ import annotations

from llmrl.config import InferenceConfig, ModelConfig
from llmrl.inference.interface import InferenceInterface, run_sync
from llmrl.registry import get_inference_class

__all__ = ["InferenceInterface", "build_inference", "run_sync"]


def build_inference(config: InferenceConfig, model: ModelConfig, *, seed: int) -> InferenceInterface:
    """The interface named by `config.type`; each registered class builds itself with `from_config`."""
    cls = get_inference_class(config.type)
    return cls.from_config(config, model, seed=seed)
