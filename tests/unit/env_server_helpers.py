"""Shared by the environment server and remote agent tests: a small arithmetic config, a scripted
inference endpoint that answers arithmetic prompts, and in-process HTTP calls to an app."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
from scripted_inference import ScriptedInference

from llmrl.config import RunConfig, config_from_dict
from llmrl.inference import Health
from llmrl.server.env_server import create_env_app
from llmrl.types import InferenceEndpoint

INFERENCE_URL = "http://inference.test/v1"
SERVER_URL = "http://env.test"

ENVIRONMENTS = [
    {"agent_type": "arithmetic", "agent_args": {"digits": 1, "eval_size": 6}},
    {"agent_type": "arithmetic", "env_id": "add2", "agent_args": {"digits": 2, "eval_size": 6}, "weight": 3},
    {
        "agent_type": "arithmetic",
        "env_id": "held",
        "agent_args": {"digits": 1, "eval_size": 4},
        "evaluation_only": True,
    },
]


def make_config(environments: list[dict[str, Any]] | None = None, seed: int = 3) -> RunConfig:
    return config_from_dict({"seed": seed, "environments": environments or ENVIRONMENTS})


def arithmetic_reply(prompt: str, index: int) -> str:
    """Even samples answer correctly, odd ones are off by one (so every group has signal)."""
    a, op, b = re.findall(r"What is (\d+) ([+*]) (\d+)\?", prompt)[-1]
    answer = int(a) + int(b) if op == "+" else int(a) * int(b)
    return str(answer if index % 2 == 0 else answer + 1)


class ScriptedEndpoint(ScriptedInference):
    """A `ScriptedInference` that also looks like an HTTP interface (it has a `base_url` to share)."""

    def __init__(self, reply=arithmetic_reply, *, base_url: str = INFERENCE_URL, model: str | None = "tiny"):
        super().__init__(reply)
        self.base_url = base_url
        self.model = model

    def health(self) -> Health:
        return Health(servers=(self.base_url,), shared_url=self.base_url, model=self.model)


class RecordingFactory:
    """An inference factory that serves every endpoint with one scripted interface and records them."""

    def __init__(self, inference: ScriptedInference | None = None):
        self.inference = inference or ScriptedEndpoint()
        self.endpoints: list[InferenceEndpoint] = []

    def __call__(self, endpoint: InferenceEndpoint) -> ScriptedInference:
        self.endpoints.append(endpoint)
        return self.inference


def make_app(config: RunConfig | None = None, factory: RecordingFactory | None = None, **kwargs: Any):
    return create_env_app(config or make_config(), inference_factory=factory or RecordingFactory(), **kwargs)


def transport(app) -> httpx.ASGITransport:
    # Unexpected server errors come back as 500 answers, as they would over a socket.
    return httpx.ASGITransport(app=app, raise_app_exceptions=False)


async def acall(app, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(transport=transport(app), base_url=SERVER_URL) as client:
        return await client.request(method, path, **kwargs)


def call(app, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request to `app`, in process."""
    return asyncio.run(acall(app, method, path, **kwargs))


def rollouts_body(**fields: Any) -> dict[str, Any]:
    return {"num_groups": 4, "group_size": 2, "inference": {"base_url": INFERENCE_URL}} | fields


def evaluate_body(**fields: Any) -> dict[str, Any]:
    return {
        "num_prompts": 3,
        "samples_per_prompt": 2,
        "ks": [1, 2],
        "inference": {"base_url": INFERENCE_URL},
    } | fields


def problem_ids(groups: list[dict[str, Any]]) -> list[str]:
    return [group["rollouts"][0]["problem_id"] for group in groups]
