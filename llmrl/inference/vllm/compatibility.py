"""Whether a vLLM server can be trained from, checked before the first request.

Training needs the dev-mode routes (``VLLM_SERVER_DEV_MODE=1``), llmrl's worker extension, the
transfer backend of the chosen transport and processed logprobs. A server lacking any of them is a
user error: one line names everything found missing and the command that starts a compatible server.
"""

from __future__ import annotations

import shlex
from typing import Any

from llmrl.config import VLLMConfig
from llmrl.errors import UserError
from llmrl.inference.openai import InferenceServerError, UnsupportedServerError
from llmrl.inference.vllm.routes import VLLMRoutes
from llmrl.inference.vllm.server import EXTENSION_CLASS, training_flags, transfer_backend
from llmrl.weights import WeightSyncError


class IncompatibleServerError(UnsupportedServerError, UserError):
    """A vLLM server was started without what training needs; the message says how to start it."""


async def check_trainable(routes: VLLMRoutes, config: VLLMConfig) -> dict[str, Any]:
    """The server's facts (`llmrl_server_facts` of the worker extension), or `IncompatibleServerError`
    naming every missing flag; `InferenceServerError` when it does not answer at all."""
    try:
        await routes.call("GET", "/health")
    except WeightSyncError as exc:
        raise InferenceServerError(str(exc).replace(" failed:", ":"), status=exc.status) from None
    facts: dict[str, Any] = {}
    missing: list[str] = []
    if await _route_missing(routes, "GET", "/weight_info"):
        missing.append(
            "VLLM_SERVER_DEV_MODE=1 in its environment (the other settings are read through its routes)"
        )
    else:
        try:
            facts = (await routes.call("POST", "/collective_rpc", json={"method": "llmrl_server_facts"}))[
                "results"
            ][0]
        except WeightSyncError as exc:
            if exc.status is None:
                raise InferenceServerError(str(exc)) from None
            missing.append(
                f"--worker-extension-cls {EXTENSION_CLASS} (the other settings are read through it)"
            )
    if facts:
        missing += _missing_settings(facts, config)
    if missing:
        raise IncompatibleServerError(
            f"vLLM at {routes.url} cannot be trained from; it lacks: {'; '.join(missing)}. Start it (with llmrl "
            f"installed beside vLLM: pip install --no-deps llmrl) as: {compatible_command(await _model(routes), config)}"
        )
    return facts


def _missing_settings(facts: dict[str, Any], config: VLLMConfig) -> list[str]:
    missing = []
    if facts.get("logprobs_mode") != "processed_logprobs":
        missing.append(f"--logprobs-mode processed_logprobs (it returns {facts.get('logprobs_mode')})")
    wanted = transfer_backend(config)
    if facts.get("weight_transfer_backend") != wanted:
        missing.append(
            f'--weight-transfer-config \'{{"backend": "{wanted}"}}\' for transport {config.transport!r} '
            f"(it has backend {facts.get('weight_transfer_backend')!r})"
        )
    elif config.transport != "nccl" and not isinstance(facts.get("manifest"), dict):
        missing.append("a checkpoint manifest (llmrl's transfer backend reported none)")
    return missing


def compatible_command(model: str, config: VLLMConfig) -> str:
    """The shell command that starts a vLLM server of `model` that llmrl can train from."""
    return "VLLM_SERVER_DEV_MODE=1 vllm serve " + shlex.join([model, *training_flags(config)])


async def _route_missing(routes: VLLMRoutes, method: str, path: str) -> bool:
    """Whether `path` is 404 (only a 404 is telling: other failures show in the next call)."""
    try:
        await routes.call(method, path)
    except WeightSyncError as exc:
        return exc.status == 404
    return False


async def _model(routes: VLLMRoutes) -> str:
    """The served model's name, for the command line (MODEL when the server does not say)."""
    try:
        return str((await routes.call("GET", "/v1/models"))["data"][0]["id"])
    except (WeightSyncError, KeyError, IndexError, TypeError):
        return "MODEL"
