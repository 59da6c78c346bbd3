"""OpenAIInterface: against the llmrl server in process (ASGI transport) and against scripted servers
(mock transports) for retries, timeouts, refusals and other servers' response shapes."""

from __future__ import annotations

import asyncio
import copy
import json
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from llmrl.config import InferenceConfig, ModelConfig
from llmrl.inference import build_inference
from llmrl.inference.engine import LocalEngine
from llmrl.inference.interface import InferenceInterface, RequestRejected
from llmrl.inference.openai import (
    InferenceServerError,
    OpenAIInterface,
    UnsupportedServerError,
    WeightSyncError,
)
from llmrl.inference.prompts import prompt_token_ids
from llmrl.server.inference_server import create_inference_app
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest

KEY = "secret"
CHAT = [ChatMessage(role="user", content="123 + 456 =")]


@pytest.fixture
def served(tiny_model, tmp_path):
    """A fresh engine behind the app, with a weights folder; returns (engine, transport, folder)."""
    model, tokenizer = tiny_model
    engine = LocalEngine(copy.deepcopy(model), tokenizer)
    folder = tmp_path / "weights"
    folder.mkdir()
    app = create_inference_app(engine, model_name="tiny", api_key=KEY, weights_dir=folder)
    return engine, httpx.ASGITransport(app), folder


def interface(transport, **kwargs) -> OpenAIInterface:
    return OpenAIInterface("http://server", api_key=KEY, transport=transport, **kwargs)


def shifted_state(engine: LocalEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() + 0.01 for k, v in engine.model.state_dict().items() if "norm" in k}


def assert_served(engine: LocalEngine, state: dict[str, torch.Tensor]) -> None:
    own = engine.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items())


# -- against the llmrl server --------------------------------------------------------------------


SAMPLING_OPTIONS = [
    GenerationArgs(max_tokens=6, seed=4, top_k=20),
    GenerationArgs(
        max_tokens=6,
        seed=5,
        min_p=0.05,
        top_p=0.9,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        min_tokens=3,
        ignore_eos=True,
        chat_template_kwargs={"unused": True},
    ),
]


@pytest.mark.parametrize("args", SAMPLING_OPTIONS, ids=["top_k", "every_option"])
@pytest.mark.parametrize("prompt", ["the fox counts 7 + 8 =", CHAT])
def test_responses_equal_the_engines_own(served, prompt, args):
    engine, transport, _ = served
    request = InferenceRequest(prompt=prompt, n=3, generation_args=args)
    remote = interface(transport)
    assert isinstance(remote, InferenceInterface)
    assert remote.generate(request) == engine.generate(request)
    assert remote.model == "tiny"  # discovered from /v1/models


def test_multi_turn_continuation_with_prompt_token_ids(served):
    engine, transport, _ = served
    remote = interface(transport, model="tiny")
    first = remote.generate(
        InferenceRequest(prompt=CHAT, generation_args=GenerationArgs(max_tokens=6, seed=1))
    )[0]
    follow_up = InferenceRequest(
        prompt=[ChatMessage(role="user", content="and 1 + 1 =")],
        prompt_token_ids=first.prompt_token_ids + first.token_ids,
        generation_args=GenerationArgs(max_tokens=6, seed=1),
    )
    second = remote.generate(follow_up)[0]
    assert second.prompt_token_ids[: len(follow_up.prompt_token_ids)] == follow_up.prompt_token_ids
    assert second == engine.generate(follow_up)[0]


def test_concurrent_agenerate_calls_share_one_loop_client(served):
    engine, transport, _ = served
    remote = interface(transport, model="tiny")

    async def many():
        requests = [
            InferenceRequest(prompt=f"{i} + {i} =", generation_args=GenerationArgs(max_tokens=4, seed=i))
            for i in range(4)
        ]
        try:
            return await asyncio.gather(*(remote.agenerate(r) for r in requests))
        finally:
            await remote.aclose()

    assert [len(r) for r in asyncio.run(many())] == [1, 1, 1, 1]


def test_in_flight_updates_reach_the_client_as_version_changes(tiny_model):
    model, tokenizer = tiny_model
    engine = LocalEngine(copy.deepcopy(model), tokenizer, weight_update="in_flight", eos_token_ids=())
    remote = interface(httpx.ASGITransport(create_inference_app(engine, model_name="tiny", api_key=KEY)))
    request = InferenceRequest(prompt="1 +", n=2, generation_args=GenerationArgs(max_tokens=600, seed=1))

    async def scenario():
        running = asyncio.ensure_future(remote.agenerate(request))
        while engine.stats.completion_tokens < 20:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(remote.update_weights, shifted_state(engine), 4)
        return await running

    for response in asyncio.run(scenario()):
        ((switch, version),) = response.version_changes
        assert response.policy_version == 0 and version == 4 and 10 <= switch < 600
        assert response.token_versions() == [0] * switch + [4] * (600 - switch)


def test_update_weights_through_a_shared_folder(served):
    engine, transport, folder = served
    remote = interface(transport, model="tiny", weights_dir=folder)
    first = shifted_state(engine)
    remote.update_weights(first, 1)
    assert remote.policy_version == 1 == engine.policy_version
    assert_served(engine, first)
    assert [p.name for p in folder.iterdir()] == ["llmrl-policy-v1.safetensors"]
    second = shifted_state(engine)
    remote.update_weights(second, 2)
    assert [p.name for p in folder.iterdir()] == ["llmrl-policy-v2.safetensors"]  # the older file is gone
    assert_served(engine, second)
    assert remote.generate(InferenceRequest(prompt="1 +"))[0].policy_version == 2
    mine = folder / "mine.safetensors"
    save_file(shifted_state(engine), str(mine))
    remote.update_weights(mine, 3)
    assert engine.policy_version == 3 and mine.exists()


def test_update_weights_streams_without_a_shared_folder(served, tmp_path):
    engine, transport, _ = served
    remote = interface(transport, model="tiny")
    state = shifted_state(engine)
    remote.update_weights(state, 1)
    assert_served(engine, state) and remote.policy_version == 1
    outside = tmp_path / "checkpoint.safetensors"
    save_file(shifted_state(engine), str(outside))
    remote.update_weights(outside, 2)
    assert engine.policy_version == 2
    remote.update_weights(outside, 2)  # the same version again is a no-op
    remote.update_weights(tmp_path, 3)  # a folder elsewhere is read, then streamed as one file
    assert engine.policy_version == 3
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        remote.update_weights(tmp_path / "weights", 4)


def test_refused_weight_updates_raise_weight_sync_error(served):
    engine, transport, _ = served
    remote = interface(transport, model="tiny")
    remote.update_weights(shifted_state(engine), 5)
    with pytest.raises(WeightSyncError, match="version 4 is older than the served version 5") as stale:
        remote.update_weights(shifted_state(engine), 4)
    assert stale.value.status == 409
    restarted = shifted_state(engine)
    remote.update_weights(restarted, 0, reset=True)  # a run starting over replaces what is served
    assert engine.policy_version == 0
    assert_served(engine, restarted)
    remote.update_weights(shifted_state(engine), 5)
    with pytest.raises(WeightSyncError, match="keys the model does not have") as bad:
        remote.update_weights({"no.such.weight": torch.zeros(2)}, 6)
    assert bad.value.status == 400 and engine.policy_version == remote.policy_version == 5
    with pytest.raises(ValueError, match="version"):
        remote.update_weights({}, -1)


# -- against scripted servers --------------------------------------------------------------------


def vllm_completion(body: dict, *, token_ids=True, logprobs=True) -> dict:
    """What vLLM (>= 0.10.2) answers to a completions request with return_token_ids and logprobs."""
    choice = {"index": 0, "text": "42", "finish_reason": "length", "prompt_token_ids": [1, 2, 3]}
    if token_ids:
        choice["token_ids"] = [7, 8]
    if logprobs:
        choice["logprobs"] = {
            "tokens": ["4", "2"],
            "token_logprobs": [-0.5, -0.25],
            "top_logprobs": None,
            "text_offset": [0, 1],
        }
    return {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice]}


def scripted(handler) -> tuple[OpenAIInterface, list[httpx.Request]]:
    """An interface served by `handler(request, attempt) -> Response` (sync or async); records requests."""
    seen: list[httpx.Request] = []

    async def respond(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = handler(request, len(seen))
        return await answer if asyncio.iscoroutine(answer) else answer

    remote = OpenAIInterface(
        "http://vllm:8000", model="m", transport=httpx.MockTransport(respond), backoff_s=0, max_retries=2
    )
    return remote, seen


def ok(request: httpx.Request, attempt: int) -> httpx.Response:
    return httpx.Response(200, json=vllm_completion(json.loads(request.content)))


def test_requests_ask_every_dialect_for_token_ids_and_logprobs():
    remote, seen = scripted(ok)
    [response] = remote.generate(
        InferenceRequest(prompt="q", generation_args=GenerationArgs(max_tokens=2, seed=0))
    )
    assert response.token_ids == [7, 8] and response.logprobs == [-0.5, -0.25]
    assert response.prompt_token_ids == [1, 2, 3]
    assert response.finish_reason == "length" and response.text == "42"
    body = json.loads(seen[0].content)
    assert str(seen[0].url) == "http://vllm:8000/v1/completions"
    assert body["return_token_ids"] is True and body["logprobs"] == 1 and body["seed"] == 0
    assert not {"top_k", "stop", "stop_token_ids", "prompt_token_ids"} & set(body)
    args = GenerationArgs(
        top_k=5,
        stop=("x",),
        stop_token_ids=(9,),
        min_p=0.1,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        min_tokens=1,
        ignore_eos=True,
    )
    remote.generate(InferenceRequest(prompt="q", generation_args=args, prompt_token_ids=[1, 2]))
    body = json.loads(seen[1].content)
    sent = {
        "top_k": 5,
        "stop": ["x"],
        "stop_token_ids": [9],
        "prompt_token_ids": [1, 2],
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.2,
        "min_tokens": 1,
        "ignore_eos": True,
    }
    assert {name: body[name] for name in sent} == sent


def test_chat_responses_in_vllm_and_sglang_shapes():
    def chat(request, attempt):
        content = [
            {"token": t, "logprob": v, "bytes": [], "top_logprobs": []} for t, v in (("h", -1.0), ("i", -2.0))
        ]
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "finish_reason": "stop",
            "logprobs": {"content": content},
            "token_ids": [5, 6],
        }
        if attempt == 1:  # vLLM: the prompt's ids at the top level
            return httpx.Response(200, json={"choices": [choice], "prompt_token_ids": [1]})
        # SGLang: the prompt's ids per choice
        return httpx.Response(200, json={"choices": [{**choice, "prompt_token_ids": [1]}]})

    remote, seen = scripted(chat)
    for _ in range(2):
        [response] = remote.generate(InferenceRequest(prompt=CHAT))
        assert response.prompt_token_ids == [1] and response.token_ids == [5, 6]
        assert response.logprobs == [-1.0, -2.0]
        assert response.text == "hi" and response.finish_reason == "stop" and response.policy_version == 0
    body = json.loads(seen[0].content)
    assert str(seen[0].url).endswith("/v1/chat/completions") and body["logprobs"] is True
    assert body["return_prompt_token_ids"] is True and body["messages"][0]["content"] == "123 + 456 ="


@pytest.mark.parametrize(
    ("answer", "field"),
    [
        (lambda body: vllm_completion(body, token_ids=False), "token_ids"),
        (lambda body: vllm_completion(body, logprobs=False), "token_logprobs"),
        (
            lambda body: {"choices": [{**vllm_completion(body)["choices"][0], "prompt_token_ids": None}]},
            "prompt_token_ids",
        ),
    ],
)
def test_servers_without_token_data_are_refused(answer, field):
    remote, _ = scripted(
        lambda request, attempt: httpx.Response(200, json=answer(json.loads(request.content)))
    )
    with pytest.raises(UnsupportedServerError, match=f"`{field}`.*cannot be trained from"):
        remote.generate(InferenceRequest(prompt="q"))


@pytest.mark.parametrize(
    "follow_up", [[ChatMessage(role="user", content="No. 1 + 2 =")], " and 3 + 4 =", ""], ids=repr
)
def test_with_the_tokenizer_a_continuation_is_sent_as_the_engines_prompt_ids(tiny_model, follow_up):
    """vLLM and SGLang read no prompt_token_ids field; they take token ids as a completions prompt."""
    _, tokenizer = tiny_model

    def echo(request: httpx.Request, attempt: int) -> httpx.Response:
        body = json.loads(request.content)
        answer = vllm_completion(body)
        answer["choices"][0]["prompt_token_ids"] = body["prompt"]  # what vLLM answers for a token prompt
        return httpx.Response(200, json=answer)

    remote, seen = scripted(echo)
    remote.tokenizer = tokenizer
    first_turn = [m.model_dump() for m in CHAT]
    conversation = tokenizer.apply_chat_template(
        first_turn, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    conversation = [*conversation, *tokenizer("579")["input_ids"], tokenizer.eos_token_id]
    args = GenerationArgs(max_tokens=2, chat_template_kwargs={"enable_thinking": False})
    request = InferenceRequest(prompt=follow_up, prompt_token_ids=conversation, generation_args=args)
    [response] = remote.generate(request)
    expected = prompt_token_ids(tokenizer, request, context=1024, vocab_size=len(tokenizer))
    body = json.loads(seen[0].content)
    assert str(seen[0].url) == "http://vllm:8000/v1/completions" and body["prompt"] == expected
    assert expected[: len(conversation)] == conversation
    assert not {"messages", "prompt_token_ids", "chat_template_kwargs"} & set(body)
    assert response.prompt_token_ids == expected and response.token_ids == [7, 8] and response.text == "42"


def test_a_server_that_ignores_prompt_token_ids_is_refused():
    remote, _ = scripted(ok)
    with pytest.raises(UnsupportedServerError, match="ignored prompt_token_ids"):
        remote.generate(InferenceRequest(prompt="q", prompt_token_ids=[9, 9]))


def test_5xx_and_connection_errors_are_retried_then_succeed():
    def flaky(request, attempt):
        if attempt == 1:
            raise httpx.ConnectError("refused")
        if attempt == 2:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return ok(request, attempt)

    remote, seen = scripted(flaky)
    assert remote.generate(InferenceRequest(prompt="q"))[0].token_ids == [7, 8]
    assert len(seen) == 3


def test_retries_are_bounded():
    remote, seen = scripted(lambda request, attempt: httpx.Response(500, text="boom"))
    with pytest.raises(InferenceServerError, match="after 3 attempt.*HTTP 500: boom") as failure:
        remote.generate(InferenceRequest(prompt="q"))
    assert failure.value.status == 500 and len(seen) == 3


def test_4xx_is_raised_at_once_with_the_servers_message():
    answer = httpx.Response(
        400, json={"error": {"message": "prompt: 2001 tokens leave no room", "type": "x"}}
    )
    remote, seen = scripted(lambda request, attempt: answer)
    with pytest.raises(InferenceServerError, match="prompt: 2001 tokens leave no room") as failure:
        remote.generate(InferenceRequest(prompt="q"))
    assert failure.value.status == 400 and len(seen) == 1
    assert isinstance(failure.value, RequestRejected)  # the request's own fault: its problem is dropped


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_refusal_of_who_asks_or_where_is_not_the_requests_fault(status):
    remote, _ = scripted(lambda request, attempt: httpx.Response(status, json={"error": "no"}))
    with pytest.raises(InferenceServerError) as failure:
        remote.generate(InferenceRequest(prompt="q"))
    assert not isinstance(failure.value, RequestRejected)


def test_a_slow_server_times_out_per_attempt():
    async def slow(request, attempt):
        await asyncio.sleep(5)
        return ok(request, attempt)

    remote, seen = scripted(slow)
    remote.timeout_s = 0.1
    start = time.perf_counter()
    with pytest.raises(InferenceServerError, match="Timeout"):
        remote.generate(InferenceRequest(prompt="q"))
    assert time.perf_counter() - start < 2 and len(seen) == 3


def test_in_flight_requests_are_bounded_by_max_concurrent():
    in_flight, peak = 0, 0

    async def tracked(request, attempt):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return ok(request, attempt)

    remote, seen = scripted(tracked)
    remote.max_concurrent = 2

    async def many():
        await asyncio.gather(*(remote.agenerate(InferenceRequest(prompt="q")) for _ in range(6)))
        await remote.aclose()

    asyncio.run(many())
    assert len(seen) == 6 and peak == 2


def test_weight_sync_timeout_raises_quickly():
    async def stuck(request, attempt):
        await asyncio.sleep(10)
        return httpx.Response(200, json={"policy_version": 1})

    remote, seen = scripted(stuck)
    remote.weight_sync_timeout_s = 0.2
    start = time.perf_counter()
    with pytest.raises(WeightSyncError, match="Timeout"):
        remote.update_weights({"w": torch.zeros(2)}, 1)
    assert time.perf_counter() - start < 2 and len(seen) == 1 and remote.policy_version == 0


def test_update_weights_works_from_inside_a_running_loop():
    remote, seen = scripted(lambda request, attempt: httpx.Response(200, json={"policy_version": 7}))

    async def from_a_coroutine():
        remote.update_weights({"w": torch.ones(3)}, 7)

    asyncio.run(from_a_coroutine())
    assert remote.policy_version == 7 and seen[0].url.params["version"] == "7"
    assert seen[0].headers["content-type"] == "application/octet-stream"


# -- construction --------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"])
def test_base_url_is_normalised(url):
    assert OpenAIInterface(url).base_url == "http://h:1/v1"


def test_from_config(monkeypatch):
    with pytest.raises(ValueError, match="inference.base_url"):
        build_inference(InferenceConfig(type="openai"), ModelConfig(), seed=0)
    config = InferenceConfig(
        type="openai",
        base_url="http://h:2/v1",
        api_key_env="LLMRL_TEST_KEY",
        max_concurrent=3,
        request_timeout_s=9,
    )
    monkeypatch.delenv("LLMRL_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="LLMRL_TEST_KEY is not set"):
        build_inference(config, ModelConfig(), seed=0)
    monkeypatch.setenv("LLMRL_TEST_KEY", "k")
    remote = build_inference(config, ModelConfig(), seed=0)
    assert isinstance(remote, OpenAIInterface)
    assert (remote.base_url, remote.max_concurrent, remote.timeout_s) == ("http://h:2/v1", 3, 9)


def test_requests_that_start_together_ask_for_the_model_once():
    def respond(request, attempt):
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": "served"}]})
        return ok(request, attempt)

    remote, seen = scripted(respond)
    remote.model, remote.max_concurrent = None, 4

    async def many():
        await asyncio.gather(*(remote.agenerate(InferenceRequest(prompt="q")) for _ in range(300)))
        await remote.aclose()

    asyncio.run(many())
    asked = [r for r in seen if r.url.path.endswith("/models")]
    assert len(asked) == 1 and len(seen) == 301
    assert {json.loads(r.content)["model"] for r in seen if r not in asked} == {"served"}
