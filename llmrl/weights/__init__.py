"""Weight movement, in one place: buckets and their serialisation, the checks a tensor must pass,
and the transports that deliver a weight version to where it serves.

| module | holds |
|---|---|
| `transport.py` | `WeightTransport` (the one interface), `Weights` (what it takes), `WeightSyncError` |
| `checks.py` | what a tensor, a state dict or a bucket must pass (against a model or a checkpoint manifest) |
| `buckets.py` | `weight_buckets` (whole decoder layers, bounded bytes), `Bucket`, safetensors bytes and files
|
| `adapters.py` | `AdapterWeights`: LoRA adapters as a payload (PEFT's names and files), their deltas and checks |
| `in_process.py` | into the embedded engine's model, between its decode steps |
| `llmrl_server.py` | to llmrl's inference server: a file in a shared folder, or streamed over HTTP |
| `nccl.py` | to vLLM's GPU workers by NCCL broadcast |
| `vllm_worker.py` | inside a vLLM server: llmrl's transfer backend and worker extension |

This package root and `checks`, `buckets`, `adapters`, `transport` and `vllm_worker` import only torch,
safetensors and vLLM: `vllm_worker` runs in vLLM's environment, where llmrl is installed without
its dependencies. Other packages import this root and the transport modules; the vLLM route
sequence that carries `Bucket`s lives with the vLLM client (`llmrl.inference.vllm`).
"""

from llmrl.weights.adapters import AdapterWeights, read_adapter
from llmrl.weights.buckets import (
    Bucket,
    delete_bucket_files,
    read_state_dict,
    safetensors_ready,
    serialised_buckets,
    tensor_bytes,
    weight_buckets,
)
from llmrl.weights.checks import (
    Manifest,
    check_names,
    check_state_dict,
    check_weights,
    manifest_tensors,
    served_tensors,
    weight_problem,
)
from llmrl.weights.in_process import InProcessTransport, WeightUpdate
from llmrl.weights.transport import Weights, WeightSyncError, WeightTransport, check_version, weight_parts

__all__ = [
    "AdapterWeights",
    "Bucket",
    "InProcessTransport",
    "Manifest",
    "WeightSyncError",
    "WeightTransport",
    "WeightUpdate",
    "Weights",
    "check_names",
    "check_state_dict",
    "check_version",
    "check_weights",
    "delete_bucket_files",
    "manifest_tensors",
    "read_adapter",
    "read_state_dict",
    "safetensors_ready",
    "serialised_buckets",
    "served_tensors",
    "tensor_bytes",
    "weight_buckets",
    "weight_parts",
    "weight_problem",
]
