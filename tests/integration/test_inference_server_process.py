"""The inference server as its own process: the official openai client and OpenAIInterface over real HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from servers import serving

from llmrl.inference.openai import OpenAIInterface, WeightSyncError
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest

pytestmark = pytest.mark.slow
KEY = "integration-key"


@pytest.fixture
def server(tiny_model_path, tmp_path):
    """``python -m llmrl serve-inference`` running: yields (base_url, weights dir); always stopped."""
    folder = tmp_path / "weights"
    folder.mkdir()
    with serving(
        "llmrl",
        "serve-inference",
        "--model",
        "tiny://arithmetic",
        "--api-key",
        KEY,
        "--weights-dir",
        str(folder),
        log_path=tmp_path / "server.log",
        headers={"Authorization": f"Bearer {KEY}"},
    ) as base_url:
        yield base_url, folder


def test_official_client_and_openai_interface_over_http(server):
    base_url, folder = server
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    completion = api.completions.create(model="tiny", prompt="7 + 8 =", max_tokens=4, seed=0, logprobs=1)
    extras = completion.to_dict()
    assert extras["policy_version"] == 0 and extras["prompt_token_ids"]
    assert (
        completion.choices[0].model_extra["token_logprobs"] == completion.choices[0].logprobs.token_logprobs
    )
    chat = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "123 + 456 ="}],
        max_tokens=6,
        seed=0,
        logprobs=True,
    )
    choice = chat.choices[0]
    assert (
        len(choice.model_extra["token_ids"]) == len(choice.logprobs.content) == chat.usage.completion_tokens
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()

    remote = OpenAIInterface(base_url, api_key=KEY, weights_dir=folder)
    request = InferenceRequest(
        prompt=[ChatMessage(role="user", content="123 + 456 =")],
        n=4,
        generation_args=GenerationArgs(max_tokens=6, seed=0),
    )
    responses = remote.generate(request)
    assert len(responses) == 4 and all(len(r.logprobs) == len(r.token_ids) for r in responses)
    assert [r.token_ids for r in remote.generate(request)] == [r.token_ids for r in responses]

    from llmrl.models import load_model

    model, _ = load_model("tiny://arithmetic")
    state = {k: v + 0.01 for k, v in model.state_dict().items() if "norm" in k}
    remote.update_weights(state, 1)  # through the shared folder
    streamed = OpenAIInterface(base_url, api_key=KEY)
    streamed.update_weights(model.state_dict(), 2)  # in the body
    assert remote.generate(request)[0].policy_version == 2
    assert (
        httpx.get(f"{base_url}/healthz", headers={"Authorization": f"Bearer {KEY}"}).json()["policy_version"]
        == 2
    )
    big = {"model.embed_tokens.weight": torch.zeros(4096, 1024)}  # 16 MiB: refused before it is read
    with pytest.raises(WeightSyncError, match="older than the served version 2") as stale:
        streamed.update_weights(big, 1)
    assert stale.value.status == 409
