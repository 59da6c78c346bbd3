"""Both servers answer every request: bad ones with 4xx in the documented shape naming the field, never a
5xx; a 500 leaves the keep-alive connection usable. Generated bodies (Hypothesis) back the examples."""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import threading
import time

import pytest
import uvicorn
from env_server_helpers import INFERENCE_URL, make_app
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmrl.inference.engine import LocalEngine
from llmrl.server.common import secure_app
from llmrl.server.inference_server import create_inference_app

CHAT = [{"role": "user", "content": "1 + 1 ="}]
GOOD_COMPLETION = {"prompt": "1 + 1 =", "max_tokens": 2}
GOOD_ROLLOUTS = {
    "num_groups": 1,
    "group_size": 2,
    "env_id": "arithmetic",
    "inference": {"base_url": INFERENCE_URL},
}


@pytest.fixture(scope="module")
def inference_client(tiny_model):
    model, tokenizer = tiny_model
    app = create_inference_app(LocalEngine(copy.deepcopy(model), tokenizer), model_name="tiny", max_n=4)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.fixture(scope="module")
def env_client():
    with TestClient(make_app(), raise_server_exceptions=False) as client:
        yield client


def assert_documented_refusal(answer, status: int, words: str) -> None:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type"} and words in error["message"], error


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        (
            "/v1/completions",
            {"prompt": "1", "temperature": 1e-300},
            400,
            "temperature must be 0 (greedy) or at least",
        ),
        ("/v1/completions", b'{"prompt": "1", "temperature": Infinity}', 422, "Infinity is not a JSON value"),
        ("/v1/completions", b'{"prompt": "1", "top_p": NaN}', 422, "NaN is not a JSON value"),
        ("/v1/completions", {"prompt": "1", "n": True}, 422, "body.n"),
        ("/v1/completions", {"prompt": "1", "max_tokens": 2.0}, 422, "body.max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "\ud800"}]},
            422,
            "body.messages.0.content: holds a lone surrogate",
        ),
        ("/v1/completions", {"prompt": "1", "stop": ["\udfff"]}, 422, "body.stop.0"),
        ("/v1/completions", "\u00e9".encode("latin-1"), 400, "body: not valid UTF-8"),
        ("/v1/completions", b"[" * 100_000, 422, "nested too deeply"),
    ],
)
def test_bodies_that_used_to_crash_get_4xx_naming_the_field(inference_client, path, body, status, words):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps escapes surrogates
    answer = inference_client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert_documented_refusal(answer, status, words)
    assert inference_client.post("/v1/completions", json=GOOD_COMPLETION).status_code == 200


@pytest.mark.parametrize("client_name", ["inference_client", "env_client"])
def test_unknown_routes_and_methods_answer_in_the_documented_shape(request, client_name):
    client = request.getfixturevalue(client_name)
    assert_documented_refusal(client.get("/v1/nothing"), 404, "Not Found")
    assert_documented_refusal(
        client.get("/v1/completions" if client_name == "inference_client" else "/v1/evaluate"),
        405,
        "Method Not Allowed",
    )
    assert_documented_refusal(client.post("/healthz", content=b"\xff"), 400, "not valid UTF-8")


def test_env_server_refuses_booleans_as_counts_and_surrogates(env_client):
    answer = env_client.post("/v1/group_rollouts", json={**GOOD_ROLLOUTS, "num_groups": True})
    assert_documented_refusal(answer, 422, "body.num_groups")
    surrogate = json.dumps({**GOOD_ROLLOUTS, "env_id": "\ud800"}).encode()
    answer = env_client.post(
        "/v1/group_rollouts", content=surrogate, headers={"Content-Type": "application/json"}
    )
    assert_documented_refusal(answer, 422, "body.env_id: holds a lone surrogate")


@contextlib.contextmanager
def served(app):
    """`app` on a real uvicorn server on loopback (a thread of this process); yields the port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def exchange(connection: socket.socket, path: str) -> tuple[int, bytes]:
    """One GET on an open keep-alive connection: its status and body."""
    connection.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += connection.recv(65536)
    return int(head.split()[1]), body


def test_a_500_keeps_the_connection_usable():
    app = FastAPI()

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("an unexpected failure")

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    with served(secure_app(app, api_key=None, max_body_bytes=1024)) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
            status, body = exchange(connection, "/boom")
            assert (
                status == 500
                and json.loads(body)["error"]["message"] == "RuntimeError: an unexpected failure"
            )
            assert exchange(connection, "/ok") == (200, b'{"ok":true}')  # same socket, still open


# -- generated bodies ----------------------------------------------------------------------------

_TEXT = st.text(st.characters(codec="utf-8") | st.characters(categories=["Cs"]), max_size=12)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | _TEXT
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)


def bodies(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[bytes]:
    """Raw bodies: JSON objects mixing the route's fields (plausible or wild values) with unknown keys,
    any JSON value at all, or bytes that are not JSON."""
    field_values = {name: strategy | _JSON for name, strategy in fields.items()}
    objects = st.fixed_dictionaries({}, optional=field_values) | st.dictionaries(_TEXT, _JSON, max_size=3)
    as_json = (objects | _JSON).map(lambda value: json.dumps(value).encode())
    return as_json | st.binary(max_size=40)


def _small_ints(low: int, high: int) -> st.SearchStrategy[int]:
    return st.integers(min_value=low, max_value=high)


COMPLETION_FIELDS = {
    "prompt": _TEXT,
    "n": _small_ints(-1, 5),
    "max_tokens": _small_ints(-1, 3),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": _small_ints(-2, 5),
    "seed": st.integers(),
    "stop": st.lists(_TEXT, max_size=2),
    "stop_token_ids": st.lists(_small_ints(-1, 300), max_size=2),
    "prompt_token_ids": st.lists(_small_ints(-1, 300), max_size=3),
    "logprobs": st.booleans() | _small_ints(0, 3),
    "stream": st.booleans(),
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "wizard"]), "content": _TEXT}),
        max_size=2,
    ),
}
ROLLOUT_FIELDS = {
    "num_groups": _small_ints(-1, 3),
    "group_size": _small_ints(-1, 3),
    "num_prompts": _small_ints(-1, 3),
    "samples_per_prompt": _small_ints(-1, 3),
    "ks": st.lists(_small_ints(-1, 3), max_size=2),
    "env_id": st.sampled_from(["arithmetic", "add2", "held", "nope"]) | _TEXT,
    "inference": st.fixed_dictionaries({"base_url": st.just(INFERENCE_URL) | _TEXT}),
    "generation_args": st.fixed_dictionaries(
        {}, optional={"temperature": st.floats(-1, 3), "max_tokens": _small_ints(0, 4)}
    ),
    "state": st.dictionaries(st.sampled_from(["arithmetic", "nope"]), _JSON, max_size=1),
}
GENERATED = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def assert_answered(answer) -> None:
    assert answer.status_code < 500, answer.text
    if answer.status_code >= 400:
        assert set(answer.json()["error"]) == {"message", "type"}


@GENERATED
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/weights"]),
    body=bodies(COMPLETION_FIELDS),
)
def test_generated_bodies_never_get_a_5xx_from_the_inference_server(inference_client, path, body):
    assert_answered(inference_client.post(path, content=body, headers={"Content-Type": "application/json"}))


@GENERATED
@given(path=st.sampled_from(["/v1/group_rollouts", "/v1/evaluate", "/v1/state"]), body=bodies(ROLLOUT_FIELDS))
def test_generated_bodies_never_get_a_5xx_from_the_environment_server(env_client, path, body):
    assert_answered(env_client.post(path, content=body, headers={"Content-Type": "application/json"}))


def test_both_servers_still_serve_after_the_generated_bodies(inference_client, env_client):
    # Runs after the generated tests in this module (pytest keeps file order): the same app instances.
    assert inference_client.post("/v1/completions", json=GOOD_COMPLETION).status_code == 200
    assert (
        inference_client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).status_code
        == 200
    )
    assert env_client.post("/v1/group_rollouts", json=GOOD_ROLLOUTS).status_code == 200
