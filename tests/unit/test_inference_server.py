"""The OpenAI-compatible inference server in process: OpenAI shapes, extensions, validation, weight sync."""

from __future__ import annotations

import asyncio
import copy

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save, save_file

from llmrl.inference.engine import LocalEngine
from llmrl.server.inference_server import create_inference_app
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest

KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "12 + 35 ="}]
OCTETS = {**AUTH, "Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def engine(tiny_model) -> LocalEngine:
    model, tokenizer = tiny_model
    return LocalEngine(copy.deepcopy(model), tokenizer)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(
        create_inference_app(engine, model_name="tiny", api_key=KEY),
        headers=AUTH,
        raise_server_exceptions=False,
    ) as client:
        yield client


@pytest.fixture
def weights_server(tiny_model, tmp_path):
    """A fresh engine (its weights change) served with a weights folder; returns (client, engine, folder)."""
    model, tokenizer = tiny_model
    engine = LocalEngine(copy.deepcopy(model), tokenizer)
    folder = tmp_path / "weights"
    folder.mkdir()
    app = create_inference_app(
        engine, model_name="tiny", api_key=KEY, weights_dir=folder, max_weights_bytes=64 * 1024**2
    )
    with TestClient(app, headers=AUTH, raise_server_exceptions=False) as client:
        yield client, engine, folder


def shifted_state(engine: LocalEngine, delta: float = 0.01) -> dict[str, torch.Tensor]:
    """The engine's weights with every norm weight moved by `delta` (a visible, valid change)."""
    return {k: v.detach().clone() + delta for k, v in engine.model.state_dict().items() if "norm" in k}


def assert_served(engine: LocalEngine, state: dict[str, torch.Tensor]) -> None:
    own = engine.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items())


# -- generation ----------------------------------------------------------------------------------


def test_completion_carries_the_engines_exact_tokens_and_logprobs(client, engine):
    answer = client.post(
        "/v1/completions",
        json={
            "model": "anything",
            "prompt": "the fox counts 7 + 8 =",
            "n": 3,
            "temperature": 1.0,
            "max_tokens": 6,
            "seed": 11,
            "logprobs": 1,
            "user": "ignored",
        },
    )
    assert answer.status_code == 200, answer.text
    data = answer.json()
    expected = engine.generate(
        InferenceRequest(
            prompt="the fox counts 7 + 8 =", n=3, generation_args=GenerationArgs(max_tokens=6, seed=11)
        )
    )
    assert data["object"] == "text_completion" and data["model"] == "anything"
    assert data["prompt_token_ids"] == expected[0].prompt_token_ids and data["policy_version"] == 0
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    for choice, want in zip(data["choices"], expected, strict=True):
        assert choice["token_ids"] == want.token_ids
        assert choice["token_logprobs"] == want.logprobs
        assert choice["text"] == want.text and choice["finish_reason"] == want.finish_reason
        assert choice["logprobs"]["token_logprobs"] == want.logprobs
        assert (
            len(choice["logprobs"]["tokens"]) == len(want.token_ids) == len(choice["logprobs"]["text_offset"])
        )
    completion_tokens = sum(len(w.token_ids) for w in expected)
    assert data["usage"] == {
        "prompt_tokens": len(expected[0].prompt_token_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(expected[0].prompt_token_ids) + completion_tokens,
    }


def test_chat_completion_carries_the_engines_exact_tokens_and_logprobs(client, engine):
    body = {
        "messages": CHAT,
        "n": 2,
        "max_completion_tokens": 5,
        "seed": 3,
        "logprobs": True,
        "temperature": 0.7,
    }
    data = client.post("/v1/chat/completions", json=body).json()
    expected = engine.generate(
        InferenceRequest(
            prompt=[ChatMessage(**m) for m in CHAT],
            n=2,
            generation_args=GenerationArgs(max_tokens=5, seed=3, temperature=0.7),
        )
    )
    assert data["object"] == "chat.completion" and data["model"] == "tiny"
    assert data["prompt_token_ids"] == expected[0].prompt_token_ids
    for choice, want in zip(data["choices"], expected, strict=True):
        assert choice["message"] == {"role": "assistant", "content": want.text}
        assert choice["token_ids"] == want.token_ids and choice["token_logprobs"] == want.logprobs
        assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == want.logprobs


def test_logprobs_in_openai_shape_only_when_asked(client):
    plain = client.post("/v1/completions", json={"prompt": "7 + 8 =", "max_tokens": 3}).json()["choices"][0]
    assert plain["logprobs"] is None and len(plain["token_logprobs"]) == len(plain["token_ids"])


def test_seeds_reproduce_and_sample_zero_matches_n_one(client):
    def tokens(seed, n=1):
        body = {"messages": CHAT, "max_tokens": 6, "seed": seed, "n": n, "temperature": 1.5}
        return [c["token_ids"] for c in client.post("/v1/chat/completions", json=body).json()["choices"]]

    assert tokens(5) == tokens(5)
    assert tokens(5, n=4)[0] == tokens(5)[0]
    assert len({tuple(t) for seed in range(6) for t in tokens(seed)}) > 1


@pytest.mark.cross_cpu
def test_stop_strings_and_stop_token_ids(client):
    base = {"messages": [{"role": "user", "content": "123 + 456 ="}], "max_tokens": 8, "temperature": 0}
    free = client.post("/v1/chat/completions", json=base).json()["choices"][0]
    ids, text = free["token_ids"], free["message"]["content"]
    assert len(ids) >= 3 and len(text) >= 2, free
    cut = client.post("/v1/chat/completions", json={**base, "stop_token_ids": [ids[1]]}).json()["choices"][0]
    assert cut["token_ids"] == ids[:2] and cut["finish_reason"] == "stop"
    for stop in (text[1], [text[1], "never appears"]):
        stopped = client.post("/v1/chat/completions", json={**base, "stop": stop}).json()["choices"][0]
        assert stopped["message"]["content"] == text[0] and stopped["finish_reason"] == "stop"
    one = client.post("/v1/chat/completions", json={**base, "max_tokens": 1}).json()["choices"][0]
    assert one["token_ids"] == ids[:1] and one["finish_reason"] == "length"


def test_prompt_token_ids_continue_a_conversation(client, engine):
    first = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "seed": 2}).json()
    prefix = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    follow_up = [{"role": "user", "content": "and 1 + 1 ="}]
    second = client.post(
        "/v1/chat/completions",
        json={"messages": follow_up, "prompt_token_ids": prefix, "max_tokens": 6, "seed": 2},
    ).json()
    expected = engine.generate(
        InferenceRequest(
            prompt=[ChatMessage(**follow_up[0])],
            prompt_token_ids=prefix,
            generation_args=GenerationArgs(max_tokens=6, seed=2),
        )
    )[0]
    assert second["prompt_token_ids"][: len(prefix)] == prefix
    assert second["prompt_token_ids"] == expected.prompt_token_ids
    assert second["choices"][0]["token_ids"] == expected.token_ids


def test_the_official_openai_client_parses_responses_and_reaches_the_extensions(client):
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=client, max_retries=0)
    completion = api.completions.create(model="tiny", prompt="7 + 8 =", max_tokens=4, seed=1, logprobs=1)
    choice = completion.choices[0]
    assert choice.logprobs.token_logprobs == choice.model_extra["token_logprobs"]
    assert completion.model_extra["policy_version"] == 0
    assert completion.to_dict()["choices"][0]["token_ids"] == choice.model_extra["token_ids"]
    chat = api.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, seed=1, logprobs=True, extra_body={"top_k": 5}
    )
    assert chat.choices[0].message.role == "assistant"
    extras = chat.choices[0].model_extra
    assert [c.logprob for c in chat.choices[0].logprobs.content] == extras["token_logprobs"]
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert api.models.list().data[0].id == "tiny"


def test_concurrent_requests_share_the_engines_batch(tiny_model):
    model, tokenizer = tiny_model
    # No eos: every completion is max_tokens long, so the step count shows the batching.
    engine = LocalEngine(copy.deepcopy(model), tokenizer, eos_token_ids=())
    app = create_inference_app(engine, model_name="tiny")

    async def two_at_once():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
            bodies = [{"prompt": p, "max_tokens": 8, "seed": 0} for p in ("1 + 2 =", "the quick brown fox")]
            return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))

    answers = asyncio.run(two_at_once())
    assert [a.status_code for a in answers] == [200, 200]
    assert engine.stats.completion_tokens == 16
    assert engine.stats.steps < 16  # one after the other would take 8 steps each


def test_models_and_health_report_the_policy_version(client):
    assert client.get("/healthz").json() == {"status": "ok", "policy_version": 0}
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["policy_version"] == 0 and card["object"] == "model"


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/completions", b'{"prompt": "1 +', 422, "JSON"),
        ("/v1/completions", {"prompt": 3}, 422, "body.prompt"),
        ("/v1/completions", {}, 422, "body.prompt"),
        ("/v1/completions", {"prompt": "1", "n": "many"}, 422, "body.n"),
        ("/v1/completions", {"prompt": "1", "n": 10000}, 400, "n: at most 64"),
        ("/v1/completions", {"prompt": "1", "n": 0}, 422, "body.n"),
        ("/v1/completions", {"prompt": "1", "max_tokens": -1}, 422, "body.max_tokens"),
        ("/v1/completions", {"prompt": "1", "temperature": -0.5}, 422, "body.temperature"),
        ("/v1/completions", {"prompt": "1", "top_p": 0}, 422, "body.top_p"),
        ("/v1/completions", {"prompt": "1", "stream": True}, 400, "stream is not supported"),
        ("/v1/completions", {"prompt": "1", "echo": True}, 400, "echo is not supported"),
        ("/v1/completions", {"prompt": "1", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
        ("/v1/completions", {"prompt": "1", "presence_penalty": 3}, 422, "body.presence_penalty"),
        ("/v1/completions", {"prompt": "1", "min_p": 2}, 422, "body.min_p"),
        ("/v1/completions", {"prompt": "1", "stop": [""]}, 400, "stop"),
        ("/v1/completions", {"prompt": "1", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": "1 + 1 " * 600}, 400, "context"),
        ("/v1/completions", {"prompt": "1", "max_tokens": 5000}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": []}, 422, "body.messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 422, "role"),
        ("/v1/chat/completions", {"messages": CHAT, "prompt_token_ids": []}, 400, "prompt_token_ids"),
        ("/v1/chat/completions", {"messages": CHAT, "stream": True}, 400, "stream is not supported"),
    ],
)
def test_malformed_requests_are_refused_and_the_server_keeps_serving(client, path, body, status, words):
    kwargs = (
        {"content": body, "headers": {**AUTH, "Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    answer = client.post(path, **kwargs)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "1 + 1 =", "max_tokens": 2}).status_code == 200


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    body = {
        "prompt": "1 + 1 =",
        "max_tokens": 2,
        "stream": False,
        "echo": False,
        "best_of": 1,
        "logit_bias": {},
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "suffix": None,
        "top_k": -1,
        "metadata": {"a": 1},
    }
    assert client.post("/v1/completions", json=body).status_code == 200


def test_every_route_needs_the_bearer_token(client):
    anonymous = TestClient(client.app, raise_server_exceptions=False)
    requests = [
        ("POST", "/v1/completions", {"prompt": "1"}),
        ("POST", "/v1/chat/completions", {"messages": CHAT}),
        ("GET", "/healthz", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/weights", {"version": 1}),
    ]
    for method, path, body in requests:
        assert anonymous.request(method, path, json=body).status_code == 401
        for wrong in ("Bearer wrong", KEY, f"Basic {KEY}"):
            answer = client.request(method, path, json=body, headers={"Authorization": wrong})
            assert answer.status_code == 401 and "bearer token" in answer.json()["error"]["message"]


def test_bodies_over_the_limits_get_413(tiny_model):
    model, tokenizer = tiny_model
    engine = LocalEngine(copy.deepcopy(model), tokenizer)
    app = create_inference_app(engine, model_name="tiny", max_body_bytes=4096, max_weights_bytes=64 * 1024)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/v1/completions", json={"prompt": "x" * 5000}).status_code == 413
        assert client.post("/v1/weights", json={"version": 1, "path": "x" * 5000}).status_code == 413
        big = save({"model.norm.weight": torch.zeros(32 * 1024)})
        answer = client.post(
            "/v1/weights?version=1", content=big, headers={"Content-Type": "application/octet-stream"}
        )
        assert answer.status_code == 413 and engine.policy_version == 0
        assert client.post("/v1/completions", json={"prompt": "1 + 1 =", "max_tokens": 2}).status_code == 200


# -- weights -------------------------------------------------------------------------------------


def test_weights_from_a_file_in_the_weights_folder(weights_server):
    client, engine, folder = weights_server
    state = shifted_state(engine)
    save_file(state, str(folder / "v1.safetensors"))
    answer = client.post("/v1/weights", json={"version": 1, "path": "v1.safetensors"})
    assert answer.status_code == 200, answer.text
    assert (
        answer.json()["policy_version"] == 1
        and answer.json()["applied"] is True
        and answer.json()["seconds"] >= 0
    )
    assert_served(engine, state)
    assert client.get("/healthz").json()["policy_version"] == 1
    assert (
        client.post("/v1/completions", json={"prompt": "1 +", "max_tokens": 2}).json()["policy_version"] == 1
    )
    absolute = shifted_state(engine)
    save_file(absolute, str(folder / "v2.safetensors"))
    assert (
        client.post("/v1/weights", json={"version": 2, "path": str(folder / "v2.safetensors")}).status_code
        == 200
    )
    assert_served(engine, absolute)


def test_weights_paths_outside_the_folder_are_refused(weights_server, tmp_path):
    client, engine, folder = weights_server
    outside = tmp_path / "outside.safetensors"
    save_file(shifted_state(engine), str(outside))
    (folder / "link.safetensors").symlink_to(outside)
    for path, status in (
        ("../outside.safetensors", 403),
        (str(outside), 403),
        ("link.safetensors", 403),
        (".", 403),
        ("missing.safetensors", 400),
    ):
        answer = client.post("/v1/weights", json={"version": 1, "path": path})
        assert answer.status_code == status, (path, answer.text)
    assert engine.policy_version == 0
    assert client.post("/v1/weights", json={"version": "one", "path": "x"}).status_code == 422
    assert client.post("/v1/weights", json={"version": 1, "path": "x", "extra": 1}).status_code == 422


def test_paths_need_a_weights_folder(client):
    answer = client.post("/v1/weights", json={"version": 1, "path": "v1.safetensors"})
    assert answer.status_code == 400 and "no weights folder" in answer.json()["error"]["message"]


def test_streamed_weights_and_versions(weights_server):
    client, engine, _ = weights_server
    state = shifted_state(engine)
    answer = client.post("/v1/weights?version=3", content=save(state), headers=OCTETS)
    assert answer.status_code == 200 and answer.json()["policy_version"] == 3
    assert_served(engine, state)
    again = client.post("/v1/weights?version=3", content=save(shifted_state(engine)), headers=OCTETS)
    assert again.status_code == 200 and again.json() == {
        "policy_version": 3,
        "seconds": 0.0,
        "applied": False,
    }
    assert_served(engine, state)
    stale = client.post("/v1/weights?version=2", content=save(state), headers=OCTETS)
    assert stale.status_code == 409
    assert "2" in stale.json()["error"]["message"] and "3" in stale.json()["error"]["message"]
    assert client.post("/v1/weights", content=save(state), headers=OCTETS).status_code == 422  # no ?version
    older = shifted_state(engine)
    reset = client.post("/v1/weights?version=0&reset=true", content=save(older), headers=OCTETS)
    assert reset.status_code == 200 and reset.json()["applied"] and engine.policy_version == 0
    assert_served(engine, older)


def test_bad_tensors_are_refused_and_the_old_weights_keep_serving(weights_server):
    client, engine, _ = weights_server
    before = copy.deepcopy(engine.model.state_dict())
    norm = next(k for k in before if "norm" in k)
    for bad in ({"no.such.weight": torch.zeros(3)}, {norm: torch.zeros(7)}):
        answer = client.post("/v1/weights?version=1", content=save(bad), headers=OCTETS)
        assert answer.status_code == 400 and "state_dict" in answer.json()["error"]["message"]
    garbage = client.post("/v1/weights?version=1", content=b"not safetensors", headers=OCTETS)
    assert garbage.status_code == 400
    assert engine.policy_version == 0 and all(
        torch.equal(v, before[k]) for k, v in engine.model.state_dict().items()
    )
    answer = client.post("/v1/completions", json={"prompt": "1 + 1 =", "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["policy_version"] == 0


def test_weights_are_checked_before_they_serve(weights_server):
    """NaN/Inf, integer or boolean tensors, huge versions and pickles get 4xx naming what is wrong."""
    import io

    client, engine, folder = weights_server
    before = copy.deepcopy(engine.model.state_dict())
    norm = next(k for k in before if "norm" in k)
    bad_values = {
        "nan": before[norm].clone().index_fill_(0, torch.tensor([1]), float("nan")),
        "inf": before[norm].clone().index_fill_(0, torch.tensor([0]), float("-inf")),
        "int64": torch.ones_like(before[norm], dtype=torch.int64),
        "bool": torch.ones_like(before[norm], dtype=torch.bool),
    }
    for kind, value in bad_values.items():
        answer = client.post("/v1/weights?version=1", content=save({norm: value}), headers=OCTETS)
        message = answer.json()["error"]["message"]
        assert answer.status_code == 400 and norm in message, (kind, message)
        assert ("non-finite" in message) if kind in ("nan", "inf") else (kind in message)
    for version in (str(2**70), "-1", "1e3", "٣"):
        answer = client.post(
            f"/v1/weights?version={version}", content=save({norm: before[norm]}), headers=OCTETS
        )
        assert answer.status_code == 422 and "query.version" in answer.json()["error"]["message"]
    save_file({norm: before[norm]}, str(folder / "ok.safetensors"))
    huge = client.post("/v1/weights", json={"version": 2**70, "path": "ok.safetensors"})
    assert huge.status_code == 422 and "body.version" in huge.json()["error"]["message"]
    pickled = io.BytesIO()
    torch.save({norm: before[norm]}, pickled)
    streamed = client.post("/v1/weights?version=1", content=pickled.getvalue(), headers=OCTETS)
    assert streamed.status_code == 400 and "not a safetensors file" in streamed.json()["error"]["message"]
    (folder / "policy.pt").write_bytes(pickled.getvalue())
    by_path = client.post("/v1/weights", json={"version": 1, "path": "policy.pt"})
    assert (
        by_path.status_code == 400
        and "policy.pt is not a safetensors file" in by_path.json()["error"]["message"]
    )
    assert engine.policy_version == 0 and all(
        torch.equal(v, before[k]) for k, v in engine.model.state_dict().items()
    )
    answer = client.post("/v1/completions", json={"prompt": "1 + 1 =", "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["policy_version"] == 0
