"""Router replay with vLLM: the one line that refuses it, decided by what the vLLM in use supports
(`llmrl.inference.vllm.routed_experts`); tests/integration/test_vllm_routes_process.py asks the real one."""

from __future__ import annotations

import sys

import pytest

from llmrl.config import ConfigError, InferenceConfig, ModelConfig, config_from_dict
from llmrl.inference.vllm import VLLMInterface
from llmrl.inference.vllm.routed_experts import (
    RoutedExpertsSupport,
    router_replay_refusal,
    vllm_routed_experts_support,
)

CPU_BUILD = RoutedExpertsSupport(version="0.32.0", device="cpu", has_flag=True, has_triton=False)
CUDA_BUILD = RoutedExpertsSupport(version="0.32.0", device="cuda", has_flag=True, has_triton=True)
BASE = {
    "model": {"spec": "tiny://arithmetic-moe"},
    "environments": [{"agent_type": "arithmetic"}],
    "training": {"router_replay": True},
}


def test_the_cpu_build_is_refused_for_lack_of_model_runner_v2():
    assert router_replay_refusal(CPU_BUILD) == (
        "training.router_replay: vLLM 0.32.0's CPU backend does not return routed experts "
        "(enable_return_routed_experts needs Model Runner V2, which needs Triton with a CPU backend "
        "(triton-cpu), and vLLM found none); use the embedded engine (inference.type: local)"
    )


def test_a_build_that_returns_routes_is_refused_because_llmrl_does_not_read_them():
    assert router_replay_refusal(CUDA_BUILD) == (
        "training.router_replay: vLLM 0.32.0 on cuda returns routed experts (enable_return_routed_experts), "
        "but llmrl does not read them from vLLM yet; use the embedded engine (inference.type: local)"
    )


def test_a_vllm_without_the_flag_and_servers_run_elsewhere_are_refused_saying_so():
    old = RoutedExpertsSupport(version="0.8.5", device="cuda", has_flag=False, has_triton=True)
    assert router_replay_refusal(old).startswith(
        "training.router_replay: vLLM 0.8.5 has no enable_return_routed_experts"
    )
    assert "llmrl does not read the experts vLLM servers route" in router_replay_refusal(None)
    assert all("\n" not in router_replay_refusal(s) for s in (CPU_BUILD, CUDA_BUILD, old, None))


def test_the_config_leaves_vllm_to_be_asked_at_the_start_and_refuses_openai():
    assert config_from_dict({**BASE, "inference": {"type": "vllm"}}).inference_for_run().record_routes
    with pytest.raises(ConfigError, match="training.router_replay: inference.type 'openai' does not return"):
        config_from_dict({**BASE, "inference": {"type": "openai", "base_url": "http://127.0.0.1:9/v1"}})


def test_servers_run_elsewhere_are_refused_before_any_request():
    config = InferenceConfig(type="vllm", base_url="http://127.0.0.1:9/v1", record_routes=True)
    with pytest.raises(ConfigError, match="llmrl does not read the experts vLLM servers route"):
        VLLMInterface.from_config(config, ModelConfig(spec="tiny://arithmetic-moe"), seed=0)


def test_an_interpreter_that_cannot_answer_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"could not ask .*missing-python's vLLM .*: No such file"):
        vllm_routed_experts_support(str(tmp_path / "missing-python"))
    with pytest.raises(ConfigError, match="could not ask .* ModuleNotFoundError: No module named 'vllm'"):
        vllm_routed_experts_support(sys.executable)  # the trainer's environment has no vllm
