"""Inference interfaces, one per backend, built from config by `build_inference`."""

from __future__ import annotations

from pathlib import Path

from llmrl.config import InferenceConfig, ModelConfig
from llmrl.inference.interface import (
    Health,
    InferenceInterface,
    InferenceUnavailableError,
    RequestRejected,
    run_sync,
)
from llmrl.registry import get_inference_class

__all__ = [
    "Health",
    "InferenceInterface",
    "InferenceUnavailableError",
    "RequestRejected",
    "build_inference",
    "run_sync",
]


def build_inference(
    config: InferenceConfig, model: ModelConfig, *, seed: int, run_dir: str | Path | None = None
) -> InferenceInterface:
    """The interface `config` describes, serving `model`: vLLM's engine in this process with
    ``inference.vllm.mode: colocate`` (`ColocatedVLLM`; under torchrun one in every process, rank 0's
    interface reaching them all: `ColocatedRanks`); otherwise the class registered as `config.type`,
    built by its `from_config`: the embedded engine (`local`), an OpenAI-compatible server or llmrl's
    own (`openai`), vLLM servers llmrl starts or you run (`vllm`), or a plug-in. Managed vLLM servers
    and a colocated engine write to the run folder."""
    run_dir = Path(run_dir) if run_dir is not None else None
    if config.type == "vllm" and config.vllm.mode == "colocate":
        from llmrl.inference.vllm.colocated import ColocatedVLLM
        from llmrl.inference.vllm.ranks import across_processes

        return across_processes(
            ColocatedVLLM.from_config(config, model, seed=seed, run_dir=run_dir), seed=seed
        )
    cls = get_inference_class(config.type)
    return cls.from_config(config, model, seed=seed, run_dir=run_dir)
