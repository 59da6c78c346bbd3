"""Weight movement, in one place: buckets and their serialisation, the checks a tensor must pass,
and the transports that deliver a weight version to where it serves.

| module | holds |
|---|---|
| `payloads.py` | what a sync carries: `FullWeights` (ordered buckets, read once) or `AdapterWeights` |
| `transport.py` | `WeightTransport` (the one interface; each declares the payload kinds it `takes`), `WeightSyncError` |
| `checks.py` | what a tensor, a state dict or a bucket must pass (against a model or a checkpoint manifest) |
| `buckets.py` | `weight_buckets` (whole decoder layers, bounded bytes), `Bucket`, safetensors bytes, files |
| `adapters.py` | `AdapterWeights`: LoRA adapters as a payload (PEFT's names and files), their deltas and checks |
| `in_process.py` | whole weights or adapters into the embedded engine's model, between its decode steps |
| `llmrl_server.py` | to llmrl's inference server: a file in a shared folder, or streamed over HTTP |
| `nccl.py` | to vLLM's GPU workers by NCCL broadcast |
| `vllm_worker.py` | inside a vLLM server: llmrl's transfer backend and worker extension |

This package root and `checks`, `buckets`, `adapters`, `payloads`, `transport` and `vllm_worker`
import only torch, safetensors and vLLM: `vllm_worker` runs in vLLM's environment, where llmrl is
installed without its dependencies. Other packages import this root and the transport modules; the
vLLM transports, which run vLLM's route sequence, live with the vLLM client (`llmrl.inference.vllm`).
"""

from llmrl.weights.adapters import AdapterWeights, read_adapter
from llmrl.weights.buckets import (
    TRANSFER_BACKEND,
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
from llmrl.weights.in_process import WeightUpdate, in_process_transports
from llmrl.weights.payloads import FullWeights, Payload, PayloadKind, payload_from
from llmrl.weights.transport import (
    WeightSyncError,
    WeightTransport,
    WrongPayloadError,
    check_version,
    transport_for,
)

__all__ = [
    "TRANSFER_BACKEND",
    "AdapterWeights",
    "Bucket",
    "FullWeights",
    "Manifest",
    "Payload",
    "PayloadKind",
    "WeightSyncError",
    "WeightTransport",
    "WeightUpdate",
    "WrongPayloadError",
    "check_names",
    "check_state_dict",
    "check_version",
    "check_weights",
    "delete_bucket_files",
    "in_process_transports",
    "manifest_tensors",
    "payload_from",
    "read_adapter",
    "read_state_dict",
    "safetensors_ready",
    "serialised_buckets",
    "served_tensors",
    "tensor_bytes",
    "transport_for",
    "weight_buckets",
    "weight_problem",
]
