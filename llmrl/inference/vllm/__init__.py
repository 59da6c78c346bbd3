"""vLLM for rollouts (`inference.type: vllm`), weights synced through vLLM's RL API.

Three modes (docs/serving.md):

- **managed**: llmrl starts `num_servers` vLLM servers itself (`server.VLLMServer`) with every flag
  training needs, waits for their ``/health``, writes their logs to the run folder, restarts one
  that dies or fails a weight sync (and gives it the last good weights), and stops them all
  whenever the interface is closed, the process exits or its parent dies (`processes`);
- **external**: the servers at `base_url` (one or a list) are checked at start (`compatibility`):
  dev mode, llmrl's worker extension and transfer backend, processed logprobs; a server lacking
  any is a user error naming them all and the command that starts a compatible one;
- **colocated** (``vllm.mode: colocate``): vLLM's engine runs in the trainer's process, stepped by
  llmrl's request driver (`llmrl.inference.driver`, the embedded engine's too), and each sync hands
  it the trainer's tensors in memory; under torchrun every process runs one, all serving rank 0.

Managed and external servers are one interface, `VLLMInterface`; colocated vLLM is another,
`ColocatedVLLM` (with `ColocatedRanks` on rank 0 under torchrun). `llmrl.inference.build_inference`
picks the one the config names.

| module | holds |
|---|---|
| `client.py` | `VLLMInterface` (managed, external): routing, failover, restarts, version stamps, the checks before a sync |
| `routes.py` | one server's control routes and the weight-sync sequence over them |
| `transports.py` | how weights reach the servers (``http``, ``disk``, ``nccl``) and what each serves |
| `adapters.py` | LoRA adapters loaded on the servers, and their lifetime there |
| `compatibility.py` | whether a server can be trained from; how a sync treats running requests |
| `routed_experts.py` | whether the vLLM in use returns routed experts (router replay), and the line refusing it |
| `server.py` | a managed server: its command line, start, readiness, stop; the model folder it loads |
| `processes.py` | server processes that never outlive the trainer |
| `colocated.py` | `ColocatedVLLM` (colocated): the engine in this process, its in-memory weight transports, sleep |
| `ranks.py` | colocated under torchrun: `ColocatedRanks` on rank 0, `RankService` on the others |

The weights themselves (checks, buckets, the NCCL broadcast, the code inside vLLM) are `llmrl.weights`'.
"""

from llmrl.inference.vllm.client import VLLMInterface
from llmrl.inference.vllm.compatibility import IncompatibleServerError
from llmrl.inference.vllm.server import VLLMServer, VLLMStartError, find_vllm_python, served_model_path

__all__ = [
    "IncompatibleServerError",
    "VLLMInterface",
    "VLLMServer",
    "VLLMStartError",
    "find_vllm_python",
    "served_model_path",
]
