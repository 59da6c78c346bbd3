"""The real-size examples: their memory plans (bench/memory_plans.py) and the 32B recipe's launch script.

The configs themselves load in test_config.py and build their environments in test_agents_examples.py
(on stand-in rows for the hub datasets), with every other example.
"""

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmrl.config import VLLMConfig, load_config
from llmrl.inference.vllm import VLLMServer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "launch_grpo_math_qwen32b.sh"
CLUSTER = {
    "NNODES": "8",
    "TRAIN_NODES": "4",
    "MASTER_ADDR": "node0",
    "ROLLOUT_HOSTS": "node4 node5 node6 node7",
}


@pytest.fixture(scope="module")
def memory_plans():
    spec = importlib.util.spec_from_file_location("memory_plans", ROOT / "bench" / "memory_plans.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_memory_plans_prints_a_plan_for_every_real_size_example(memory_plans, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["memory_plans.py"])
    memory_plans.main()
    out = capsys.readouterr().out
    for name in ("gsm8k_qwen2.5_1.5b.yaml", "gsm8k_qwen2.5_7b.yaml", "grpo_math_qwen32b.yaml"):
        assert f"== examples/{name}" in out and f"| `examples/{name}` |" in out
    assert "memory plan per rank (cuda, 80.0 GB; 32763.9M parameters, 32 process(es))" in out


def test_every_real_size_plan_fits_an_80_gb_gpu(memory_plans):
    for layout in memory_plans.LAYOUTS:
        config, plan = memory_plans.plan_of(layout)
        assert config.inference.type == "vllm" and "engine" not in plan.terms(rank0=True)
        assert plan.settings.master_dtype != plan.settings.compute_dtype  # bf16 compute, fp32 master
        plan.check()  # raises with the plan when it does not fit


def test_the_32b_recipe_is_megatron_rls(memory_plans):
    layout = next(lay for lay in memory_plans.LAYOUTS if lay.example == "grpo_math_qwen32b.yaml")
    config, plan = memory_plans.plan_of(layout)
    assert layout.train_gpus + layout.vllm_gpus == 64 and plan.total() < 80e9
    training = config.training
    assert (training.steps, training.group_size, training.prompts_per_step, training.lr) == (
        300,
        16,
        64,
        1e-6,
    )
    assert config.evaluation.samples_per_prompt == 32 and config.evaluation.ks == [1, 32]


def _launch(node_rank, *args, **env):
    environment = {**os.environ, **CLUSTER, "NODE_RANK": str(node_rank), "DRY_RUN": "1", **env}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=environment, timeout=60
    )


def test_the_launch_script_is_valid_bash_and_explains_itself():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert "Usage:" in subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True).stdout


def test_the_launch_script_refuses_missing_or_inconsistent_variables():
    bare = {k: v for k, v in os.environ.items() if k not in {*CLUSTER, "NODE_RANK"}}
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=bare, timeout=60)
    assert result.returncode == 2
    assert "missing variables: NNODES TRAIN_NODES NODE_RANK MASTER_ADDR ROLLOUT_HOSTS" in result.stderr
    assert "ROLLOUT_HOSTS names 2 hosts" in _launch(0, ROLLOUT_HOSTS="a b").stderr
    assert "NODE_RANK must be in 0 .. NNODES-1" in _launch(8).stderr
    assert "needs WEIGHTS_DIR" in _launch(0, TRANSPORT="disk").stderr


def test_a_training_node_runs_torchrun_with_every_server_as_base_url():
    result = _launch(1, "--set", "training.steps=2")
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert command[command.index("--nnodes") + 1] == "4" and command[command.index("--node-rank") + 1] == "1"
    overrides = [command[i + 1] for i, word in enumerate(command) if word == "--set"]
    config = load_config(ROOT / command[command.index("train") + 1], overrides)
    assert config.inference.base_url == [
        f"http://node{n}:{port}" for n in (4, 5, 6, 7) for port in (8000, 8001)
    ]
    assert config.inference.vllm.transport == "nccl" and config.training.steps == 2


def test_a_rollout_node_starts_its_servers_with_every_flag_llmrl_checks_for(tmp_path):
    result = _launch(6)
    assert result.returncode == 0, result.stderr
    servers = [shlex.split(line) for line in result.stdout.splitlines()]
    assert [s[1] for s in servers] == ["CUDA_VISIBLE_DEVICES=0,1,2,3", "CUDA_VISIBLE_DEVICES=4,5,6,7"]
    config = load_config(ROOT / "examples" / "grpo_math_qwen32b.yaml")
    for port, server in zip((8000, 8001), servers, strict=True):
        assert "VLLM_SERVER_DEV_MODE=1" in server
        vllm = VLLMConfig(
            transport=config.inference.vllm.transport,
            tensor_parallel_size=4,
            max_model_len=16384,
            host="0.0.0.0",
            python=sys.executable,
        )
        managed = VLLMServer(
            model=config.model.spec,
            dtype=config.model.dtype,
            config=vllm,
            port=port,
            log_path=tmp_path / "log",
            seed=0,
            devices="0,1,2,3",
        ).command()
        script = server[server.index("-m") :]
        assert script == managed[managed.index("-m") :]  # the flags a managed server gets, in the same order


def test_the_plans_in_docs_training_md_are_the_scripts(memory_plans, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["memory_plans.py", "--markdown"])
    memory_plans.main()
    assert capsys.readouterr().out.strip() in (ROOT / "docs" / "training.md").read_text()
