"""LoRA adapters on a real vLLM server (the CPU build here; `bash scripts/setup.sh vllm` installs it).

One server of the tiny model with LoRA on starts for the module (as a managed one starts, ~1 min on 2
cores). After each adapter sync, vLLM's logprobs must match the trainer's forward with that adapter,
every request admitted after the sync must use the new version (its stamp), and a request running
through a sync must finish on the version it started with. Then `llmrl train` of the LoRA example
for a few steps, with no vLLM process left behind.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from llmrl.config import LoraConfig, ModelConfig, VLLMConfig
from llmrl.inference.vllm import VLLMInterface, VLLMServer, served_model_path
from llmrl.models import load_model
from llmrl.processes import free_port
from llmrl.trainer.lora import Adapters
from llmrl.types import GenerationArgs, InferenceRequest
from tests.integration.test_vllm import run_training, train_command, vllm_processes

pytestmark = pytest.mark.slow

LORA = LoraConfig(rank=16, alpha=32)
CONFIG = VLLMConfig(max_model_len=256, cpu_kv_cache_gib=1, startup_timeout_s=300, max_loras=3)
PROMPTS = ["12 + 34 =", "7 + 58 =", "90 + 9 ="]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = served_model_path(ModelConfig(), tmp_path_factory.mktemp("vllm-lora") / "model")
    started = VLLMServer(
        model=model_dir,
        dtype="float32",
        config=CONFIG,
        port=free_port(),
        seed=0,
        log_path=tmp_path_factory.mktemp("vllm-lora-logs") / "server.log",
        lora_rank=LORA.rank,
    )
    try:
        started.start()
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def base_model():
    return load_model("tiny://arithmetic")[0].float().eval()


def adapters_of(base_model, seed: int) -> Adapters:
    """Adapters with random B (as after training: the policy is not the base)."""
    torch.manual_seed(seed)
    adapters = Adapters(copy.deepcopy(base_model), LORA)
    with torch.no_grad():
        for name, parameter in adapters.peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    return adapters


def trainer_logprobs(adapters: Adapters, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = adapters.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def request(prompt: str, **args) -> InferenceRequest:
    return InferenceRequest(
        prompt=prompt, n=4, generation_args=GenerationArgs(seed=1, **{"max_tokens": 12} | args)
    )


def max_gap(responses, adapters: Adapters) -> float:
    return max(
        (trainer_logprobs(adapters, r.prompt_token_ids, r.token_ids) - torch.tensor(r.logprobs))
        .abs()
        .max()
        .item()
        for r in responses
    )


def test_after_each_adapter_sync_requests_sample_the_new_version_as_the_trainer_computes_it(
    server, base_model, tmp_path
):
    vllm = VLLMInterface([server.base_url], config=CONFIG, lora_rank=LORA.rank, weights_dir=tmp_path)
    first, second = adapters_of(base_model, 1), adapters_of(base_model, 2)
    vllm.update_weights(first.weights(), version=1, reset=True)
    responses = [r for p in PROMPTS for r in vllm.generate(request(p))]
    assert {r.policy_version for r in responses} == {1}
    assert max_gap(responses, first) < 1e-4

    # A long request running through the next sync finishes on the version it started with.
    running: list = []
    long = request(PROMPTS[0], max_tokens=200, ignore_eos=True)
    thread = threading.Thread(target=lambda: running.extend(vllm.generate(long)))
    thread.start()
    time.sleep(0.5)
    vllm.update_weights(second.weights(), version=2)
    after = [r for p in PROMPTS for r in vllm.generate(request(p))]
    thread.join()
    assert {r.policy_version for r in after} == {2}
    assert max_gap(after, second) < 1e-4
    assert max_gap(after, first) > 1e-2  # the versions differ where it matters
    assert {r.policy_version for r in running} == {1} and all(len(r.token_ids) == 200 for r in running)
    assert max_gap(running, first) < 1e-4

    vllm.update_weights(first.weights(), version=3)  # version 1's requests are done: unloaded
    assert len(list(tmp_path.iterdir())) == 1
    vllm.close()
    assert list(tmp_path.iterdir()) == []


def test_llmrl_train_with_lora_on_managed_vllm_matches_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    lines = run_training(train_command("arithmetic_vllm_lora.yaml", run_dir, "training.steps=3"), run_dir)
    steps = [line for line in lines if "train/mismatch_kl" in line]
    assert len(steps) == 3 and max(abs(s["train/mismatch_kl"]) for s in steps) < 1e-5
    assert all(s["sync/bytes"] < 1e6 for s in steps)  # the adapters alone
    assert "--enable-lora" in (run_dir / "vllm" / "server-0.log").read_text()
    assert vllm_processes(run_dir) == []
