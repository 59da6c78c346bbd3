"""llmrl's code inside a vLLM server: a weight-transfer backend and a worker extension.

vLLM loads this module into its worker processes when it is started with
``--worker-extension-cls llmrl.weights.vllm_worker.LlmrlWorkerExtension`` and
``--weight-transfer-config '{"backend": "llmrl"}'`` (llmrl's managed servers are; see
docs/serving.md for an external one). It imports only torch, safetensors, vLLM and the narrow
modules of `llmrl.weights` (torch and safetensors only), so it runs in vLLM's own environment with
llmrl installed there without dependencies (``pip install --no-deps``).

- The **backend** ("llmrl") receives weights through vLLM's RL routes
  (``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``), one bucket per
  ``/update_weights``: either the bytes of a safetensors file in the request (``data``, base64:
  the in-memory transport, which needs no GPU and walks the same route sequence as NCCL) or the
  path of one on a disk both sides read (``path``). A trainer with vLLM in its own process
  (``inference.vllm.mode: colocate``) makes the same calls with the tensors themselves
  (``tensors``). Every tensor of a bucket is checked against the served checkpoint (known name,
  same shape, floating and finite), and nothing is loaded before ``/finish_weight_update`` has the
  whole checkpoint, so a refused update leaves the served weights untouched (the trainer checks all
  of this before it sends, too).
- The **worker extension** adds ``llmrl_server_facts``, called through ``/collective_rpc``: what
  the trainer checks before it trains from a server (logprobs mode, transfer backend, dtype, LoRA
  rank and slots) and the checkpoint's tensor manifest (names, dtypes, shapes) that syncs are
  validated against.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from llmrl.weights.buckets import TRANSFER_BACKEND
from llmrl.weights.checks import Manifest, manifest_problem


@dataclass
class LlmrlInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the buckets arrive in the update requests themselves."""


@dataclass
class LlmrlUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: the names it must hold, and its safetensors bytes (base64), a file path, or (from a
    trainer in vLLM's own process, `llmrl.inference.vllm.colocated`) the tensors themselves."""

    names: list[str] = field(default_factory=list)
    data: str | None = None
    path: str | None = None
    tensors: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if sum(part is not None for part in (self.data, self.path, self.tensors)) != 1:
            raise ValueError(
                "update_info: give exactly one of `data` (base64 safetensors), `path` and `tensors`"
            )


class LlmrlWeightTransferEngine(WeightTransferEngine[LlmrlInitInfo, LlmrlUpdateInfo]):
    """Loads checked buckets of checkpoint-format tensors with vLLM's layerwise reload."""

    init_info_cls = LlmrlInitInfo
    update_info_cls = LlmrlUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.manifest = checkpoint_manifest(vllm_config.model_config.model)
        self.pending: dict[str, torch.Tensor] = {}

    def init_transfer_engine(self, init_info: LlmrlInitInfo) -> None:
        del init_info

    def start_weight_update(self) -> None:
        self.pending = {}  # whatever a refused update left

    def receive_weights(self, update_info: LlmrlUpdateInfo) -> None:
        """Check a bucket and hold it: nothing is loaded before the whole update has arrived, so a
        refused bucket leaves the served weights as they were (vLLM's layerwise reload, once
        started, leaves a model that cannot generate until it is finished)."""
        if update_info.tensors is not None:
            tensors = update_info.tensors
        elif update_info.path is not None:
            tensors = load_file(update_info.path)
        else:
            assert update_info.data is not None
            tensors = load_safetensors_bytes(base64.b64decode(update_info.data))
        if sorted(tensors) != sorted(update_info.names):
            raise ValueError(f"update_info: the bucket holds {sorted(tensors)}, not the names sent")
        for name, tensor in tensors.items():
            problem = manifest_problem(name, tensor, self.manifest)
            if problem:
                self.pending = {}
                raise ValueError(f"update_info: {problem}")
        self.pending.update(tensors)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        pending, self.pending = self.pending, {}
        missing = sorted(set(self.manifest) - set(pending))
        if missing:  # fused weights (q/k/v, gate/up) loaded in part would serve silently wrong
            raise ValueError(
                f"finish_weight_update: the update lacks {len(missing)} tensor(s), e.g. {missing[:3]}"
            )
        initialize_layerwise_reload(self.model)
        self.model.load_weights((name, tensor.to(self.device)) for name, tensor in pending.items())
        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_heads_on_cpu(self.model)

    def shutdown(self) -> None:
        pass


def repack_tied_heads_on_cpu(model: torch.nn.Module) -> None:
    """Repack the LM head's oneDNN copy of its weight on vLLM's CPU build.

    vLLM-CPU packs the weight of each matmul layer for oneDNN after loading. A reload repacks the
    layers it loads into, but a tied LM head has no weights of its own (it shares the embeddings),
    so it kept its old packed copy: after a change of the embeddings its logprobs were off by up
    to 0.86 nats while the rest of the model matched a forward pass to 2e-6.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)


def checkpoint_manifest(model: str) -> Manifest:
    """``{name: {"dtype", "shape"}}`` of every tensor in the safetensors files of `model` (a folder,
    or a hub id already in the local cache), read from the file headers only."""
    folder = Path(model)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model, allow_patterns=["*.safetensors"], local_files_only=True))
    manifest: Manifest = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                piece = handle.get_slice(name)
                manifest[name] = {"dtype": piece.get_dtype(), "shape": list(piece.get_shape())}
    if not manifest:
        raise ValueError(f"{folder} holds no .safetensors files: llmrl syncs weights in safetensors format")
    return manifest


class LlmrlWorkerExtension:
    """Methods mixed into vLLM's worker, reachable with ``POST /collective_rpc``."""

    def llmrl_abandon_weight_update(self) -> None:
        """End a weight update that failed, whatever its stage: vLLM's worker keeps the session of an
        update refused at its finish open, and refuses every later start."""
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, LlmrlWeightTransferEngine):
            engine.pending = {}
        if getattr(self, "_weight_update_active", False) and engine is not None:
            engine.reset_weight_update_target()
            self._weight_update_active = False

    def llmrl_server_facts(self) -> dict[str, Any]:
        config = self.vllm_config  # type: ignore[attr-defined]
        transfer = config.weight_transfer_config
        engine = getattr(self, "weight_transfer_engine", None)
        manifest = engine.manifest if isinstance(engine, LlmrlWeightTransferEngine) else None
        lora = config.lora_config
        return {
            "logprobs_mode": str(config.model_config.logprobs_mode),
            "weight_transfer_backend": transfer.backend if transfer is not None else None,
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "max_model_len": config.model_config.max_model_len,
            "model": str(config.model_config.model),
            "manifest": manifest,
            "lora": {"max_lora_rank": lora.max_lora_rank, "max_loras": lora.max_loras} if lora else None,
            "pid": os.getpid(),
        }


WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, LlmrlWeightTransferEngine)

__all__ = ["LlmrlWeightTransferEngine", "LlmrlWorkerExtension", "checkpoint_manifest"]
