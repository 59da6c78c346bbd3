"""Router replay with the real vLLM (its CPU build here; `bash scripts/setup.sh vllm` installs it in
.venv-vllm, and a missing one fails these tests, as every vLLM test).

vLLM 0.32 returns routed experts only on Model Runner V2, which its CPU build cannot run without
Triton's CPU backend, so router replay refuses vLLM at the start (`llmrl.inference.vllm.routed_experts`).
These tests hold llmrl's verdict to vLLM's own: vLLM asked for routes starts exactly when llmrl says it
returns them, and a managed or colocated run is refused with the line for the vLLM in use.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from llmrl.config import ConfigError, config_from_dict
from llmrl.inference.vllm import find_vllm_python
from llmrl.inference.vllm.routed_experts import router_replay_refusal, vllm_routed_experts_support
from llmrl.models.loading import resolve_model_spec
from llmrl.trainer import Trainer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
MOE = "tiny://arithmetic-moe"

# vLLM's offline engine asked for routes, with the CPU build's settings (tests/integration/test_vllm.py).
START_WITH_ROUTES = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
from vllm import LLM
LLM(model=sys.argv[1], dtype="float32", enable_return_routed_experts=True, max_model_len=256,
    enable_chunked_prefill=False, max_num_seqs=1)
"""

# A colocated engine's refusal, in vLLM's interpreter (the trainer's has no vllm).
COLOCATED_REFUSAL = """
from llmrl.config import ConfigError, InferenceConfig, ModelConfig
from llmrl.inference.vllm.colocated import ColocatedVLLM
config = InferenceConfig(type="vllm", vllm={"mode": "colocate"}, record_routes=True)
try:
    ColocatedVLLM.from_config(config, ModelConfig(spec="tiny://arithmetic-moe"), seed=0)
except ConfigError as exc:
    print(exc)
"""


@pytest.fixture(scope="module")
def python() -> str:
    return find_vllm_python(None)


@pytest.fixture(scope="module")
def refusal(python) -> str:
    return router_replay_refusal(vllm_routed_experts_support(python))


def test_vllm_asked_for_routes_starts_exactly_when_llmrl_says_it_returns_them(python):
    support = vllm_routed_experts_support(python)
    started = subprocess.run(
        [python, "-c", START_WITH_ROUTES, resolve_model_spec(MOE)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    returns_routes = support.has_flag and support.has_triton
    assert (started.returncode == 0) == returns_routes, (support, started.stderr[-3000:])
    if support.has_flag and not returns_routes:
        assert "requires Model Runner V2" in started.stderr or "requires Triton" in started.stderr


def test_a_managed_vllm_run_is_refused_at_the_start_saying_why(tmp_path, refusal):
    config = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "model": {"spec": MOE},
            "inference": {"type": "vllm"},
            "environments": [{"agent_type": "arithmetic"}],
            "training": {"router_replay": True},
        }
    )
    with pytest.raises(ConfigError) as refused:
        Trainer(config)
    assert str(refused.value) == refusal
    assert not (tmp_path / "run" / "vllm").exists()  # refused before a server started


def test_a_colocated_engine_is_refused_before_it_starts(python, refusal):
    done = subprocess.run(
        [python, "-c", COLOCATED_REFUSAL], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == refusal
