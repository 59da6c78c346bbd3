"""Multi-turn on real vLLM (the CPU build here; `bash scripts/setup.sh vllm` installs it), token-exact.

A conversation continued from ``prompt_token_ids`` reaches vLLM as a token prompt: the prompt ids
are the ones the embedded engine would use, and the logprobs those of a float32 forward pass. Then
the retry agent program (examples/retry_agent.py) trains on a managed vLLM server: no placeholders,
and the trainer's logprobs of the sampled tokens match vLLM's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmrl.config import InferenceConfig, ModelConfig, VLLMConfig
from llmrl.inference.prompts import prompt_token_ids
from llmrl.inference.vllm import VLLMInterface
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest
from tests.integration.test_openai_agent_training import train_retry_program

pytestmark = pytest.mark.slow

VLLM = {"num_servers": 1, "transport": "http", "max_model_len": 256, "cpu_kv_cache_gib": 1}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vllm-multiturn")
    config = InferenceConfig(type="vllm", vllm=VLLMConfig(**VLLM, startup_timeout_s=300))
    interface = VLLMInterface.from_config(config, ModelConfig(dtype="float32"), seed=0, run_dir=run_dir)
    try:
        yield interface, run_dir / "vllm" / "model"
    finally:
        interface.close()


def forward_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def test_a_continued_conversation_has_the_engines_prompt_ids_and_the_forward_logprobs(vllm):
    interface, model_dir = vllm
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    args = GenerationArgs(max_tokens=8, seed=3)
    first = InferenceRequest(prompt=[ChatMessage(role="user", content="12 + 34 =")], generation_args=args)
    (reply,) = interface.generate(first)
    conversation = reply.prompt_token_ids + reply.token_ids
    follow_ups = [
        [ChatMessage(role="user", content="No, that is wrong. 12 + 34 =")],  # a chat turn
        " and 5 + 6 =",  # text
        "",  # exactly the ids (an agent program's endpoint renders the whole conversation)
    ]
    for follow_up in follow_ups:
        request = InferenceRequest(prompt=follow_up, prompt_token_ids=conversation, generation_args=args, n=2)
        expected_ids = prompt_token_ids(interface.tokenizer, request, context=256, vocab_size=10**6)
        for response in interface.generate(request):
            assert response.prompt_token_ids == expected_ids, follow_up
            assert response.token_ids
            gap = forward_logprobs(model, expected_ids, response.token_ids) - torch.tensor(response.logprobs)
            assert gap.abs().max().item() < 1e-4, follow_up


def test_the_retry_program_trains_on_managed_vllm(tmp_path):
    inference = {"type": "vllm", "max_concurrent": 256, "vllm": VLLM}
    steps = train_retry_program(
        tmp_path / "run", inference=inference, evaluation={"every": 0, "at_start": False}
    )
    assert len(steps) == 3
    for metrics in steps:
        assert metrics["rollout/placeholder_frac"] == 0.0
        # vLLM's logprobs of the trained tokens, to float noise
        assert abs(metrics["train/mismatch_kl"]) < 1e-5
        assert 1.0 <= metrics["reward/openai_agent/calls"] <= 3.0
    assert max(metrics["reward/openai_agent/calls"] for metrics in steps) > 1.0  # conversations continued
