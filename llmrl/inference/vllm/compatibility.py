"""Whether a vLLM server can be trained from, checked before the first request.

Training needs the dev-mode routes (``VLLM_SERVER_DEV_MODE=1``), llmrl's worker extension, the
transfer backend of the chosen transport and processed logprobs; with LoRA, the adapter routes
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), LoRA at a rank at least the adapters' and the adapter
slots of `VLLMConfig.max_loras`. A server lacking any of them is a user error: one line names
everything found missing and the command that starts a compatible server.
"""

from __future__ import annotations

import logging
import shlex
from typing import Any, Literal

from llmrl.config import InferenceConfig, VLLMConfig
from llmrl.errors import UserError
from llmrl.inference.openai import InferenceServerError, UnsupportedServerError
from llmrl.inference.vllm.routes import VLLMRoutes
from llmrl.inference.vllm.server import (
    EXTENSION_CLASS,
    max_lora_rank,
    training_environment,
    training_flags,
    transfer_backend,
)

log = logging.getLogger(__name__)


class IncompatibleServerError(UnsupportedServerError, UserError):
    """A vLLM server was started without what training needs; the message says how to start it."""


def vllm_pause_mode(config: InferenceConfig) -> Literal["wait", "abort"]:
    """How a sync pauses vLLM for `config.weight_update`: `in_flight` runs as `wait`, with a notice.

    vLLM 0.32 can keep requests running across an update (``pause_generation(mode="keep",
    clear_cache=False)``), but not as llmrl's in-flight updates need: its responses do not say at
    which token the new weights took over (no version per token), and its prefix cache cannot be
    reset while kept requests hold blocks (`reset_prefix_cache` fails, or preempts them and recomputes
    their cache with the new weights), so new requests could reuse prefixes the old weights computed.
    """
    if config.weight_update != "in_flight":
        return config.weight_update
    log.warning(
        "inference.weight_update: in_flight runs as wait on vLLM (its responses carry no version per token, "
        "and its prefix cache cannot be reset under running requests; docs/training.md)"
    )
    return "wait"


async def check_trainable(
    routes: VLLMRoutes, config: VLLMConfig, lora_rank: int | None = None
) -> dict[str, Any]:
    """The server's facts (`llmrl_server_facts` of the worker extension), or `IncompatibleServerError`
    naming every missing flag; `InferenceServerError` when it does not answer at all. `lora_rank`:
    the rank of the LoRA adapters it will be sent (None: full weights)."""
    await routes.call("GET", "/health", error=InferenceServerError)
    facts: dict[str, Any] = {}
    missing: list[str] = []
    if await _route_missing(routes, "GET", "/weight_info"):
        missing.append(
            "VLLM_SERVER_DEV_MODE=1 in its environment (the other settings are read through its routes)"
        )
    else:
        try:
            answer = await routes.call(
                "POST", "/collective_rpc", json={"method": "llmrl_server_facts"}, error=InferenceServerError
            )
            facts = answer["results"][0]
        except InferenceServerError as exc:
            if exc.status is None:
                raise
            missing.append(
                f"--worker-extension-cls {EXTENSION_CLASS} (the other settings are read through it)"
            )
    if facts:
        missing += _missing_settings(facts, config)
    if lora_rank is not None:
        missing += await _missing_lora(routes, facts, config, lora_rank)
    if missing:
        command = compatible_command(await _model(routes), config, lora_rank)
        raise IncompatibleServerError(
            f"vLLM at {routes.url} cannot be trained from; it lacks: {'; '.join(missing)}. Start it (with llmrl "
            f"installed beside vLLM: pip install --no-deps llmrl) as: {command}"
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


async def _missing_lora(
    routes: VLLMRoutes, facts: dict[str, Any], config: VLLMConfig, lora_rank: int
) -> list[str]:
    missing = []
    if await _route_missing(routes, "POST", "/v1/load_lora_adapter"):
        missing.append(
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment (adapters are loaded at each sync)"
        )
    if not facts:
        return missing  # the rest is read through the worker extension
    lora = facts.get("lora")
    if lora is None:
        missing.append(
            f"--enable-lora --max-lora-rank {max_lora_rank(lora_rank)} --max-loras {config.max_loras}"
        )
        return missing
    if lora["max_lora_rank"] < lora_rank:
        missing.append(
            f"--max-lora-rank {max_lora_rank(lora_rank)} for rank-{lora_rank} adapters "
            f"(it has {lora['max_lora_rank']})"
        )
    if lora["max_loras"] < config.max_loras:
        missing.append(
            f"--max-loras {config.max_loras}, the adapter versions requests may run on at once "
            f"(it has {lora['max_loras']})"
        )
    return missing


def compatible_command(model: str, config: VLLMConfig, lora_rank: int | None = None) -> str:
    """The shell command that starts a vLLM server of `model` that llmrl can train from."""
    environment = " ".join(f"{k}={v}" for k, v in training_environment(lora_rank is not None).items())
    return f"{environment} vllm serve " + shlex.join([model, *training_flags(config, lora_rank)])


async def _route_missing(routes: VLLMRoutes, method: str, path: str) -> bool:
    """Whether `path` is 404 (only a 404 is telling: other failures show in the next call)."""
    try:
        await routes.call(method, path, error=InferenceServerError)
    except InferenceServerError as exc:
        return exc.status == 404
    return False


async def _model(routes: VLLMRoutes) -> str:
    """The served model's name, for the command line (MODEL when the server does not say)."""
    try:
        return str((await routes.call("GET", "/v1/models", error=InferenceServerError))["data"][0]["id"])
    except (InferenceServerError, KeyError, IndexError, TypeError):
        return "MODEL"
