"""Allowlisted names for agents and inference interfaces.

Configs name components by short registry names (`agent_type: arithmetic`), never by import path,
so a config that arrives over the network cannot make a process import arbitrary code. The
built-in entries are resolved lazily (importing an agent pulls in its dependencies only when it is
used). A *local* config may load user plug-ins through its explicit `plugins:` field: each listed
module is imported and calls `register_agent` / `register_inference` itself.
"""

from __future__ import annotations

import importlib
from typing import Any

_BUILTIN_AGENTS: dict[str, str] = {
    "arithmetic": "llmrl.envs.arithmetic:ArithmeticAgent",
    "countdown": "llmrl.envs.countdown:CountdownAgent",
    "math": "llmrl.envs.math:MathAgent",
    "gsm8k": "llmrl.envs.math:GSM8KAgent",
    "code": "llmrl.envs.code:CodeAgent",
    "dataset": "llmrl.agents.dataset:DatasetAgent",
    "remote": "llmrl.agents.remote:RemoteAgent",
}

_BUILTIN_INFERENCE: dict[str, str] = {
    "local": "llmrl.inference.engine:LocalEngine",
    "openai": "llmrl.inference.openai:OpenAIInterface",
    "vllm": "llmrl.inference.vllm:VLLMInterface",
}

_agents: dict[str, str | type] = dict(_BUILTIN_AGENTS)
_inference: dict[str, str | type] = dict(_BUILTIN_INFERENCE)


class RegistryError(ValueError):
    """An unknown or unavailable registry name."""


def _resolve(table: dict[str, str | type], kind: str, name: str) -> type:
    if not isinstance(name, str) or name not in table:
        valid = ", ".join(sorted(table))
        hint = " Import paths are not accepted; register plug-ins via `plugins:` in a local config." if (
            isinstance(name, str) and ("." in name or ":" in name)
        ) else ""
        raise RegistryError(f"unknown {kind} {name!r}; valid names: {valid}.{hint}")
    entry = table[name]
    if isinstance(entry, type):
        return entry
    module_name, _, attr = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise RegistryError(f"{kind} {name!r} is registered but not available in this version of llmrl") from None
        raise
    cls = getattr(module, attr)
    table[name] = cls
    return cls


def _register(table: dict[str, str | type], kind: str, name: str, cls: type, replace: bool) -> type:
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise RegistryError(f"{kind} name {name!r} must be letters, digits, '-' or '_'")
    if name in table and table[name] is not cls and not replace:
        raise RegistryError(f"{kind} {name!r} is already registered; pass replace=True to override it")
    table[name] = cls
    return cls


def agent_names() -> list[str]:
    return sorted(_agents)


def inference_names() -> list[str]:
    return sorted(_inference)


def get_agent_class(name: str) -> type:
    """The agent class registered under `name`; unknown names list the valid ones."""
    return _resolve(_agents, "agent type", name)


def get_inference_class(name: str) -> type:
    """The inference interface class registered under `name`."""
    return _resolve(_inference, "inference type", name)


def register_agent(name: str, cls: type | None = None, *, replace: bool = False) -> Any:
    """Register an agent class; usable as ``@register_agent("name")``."""
    if cls is None:
        return lambda c: _register(_agents, "agent type", name, c, replace)
    return _register(_agents, "agent type", name, cls, replace)


def register_inference(name: str, cls: type | None = None, *, replace: bool = False) -> Any:
    """Register an inference interface class; usable as a decorator."""
    if cls is None:
        return lambda c: _register(_inference, "inference type", name, c, replace)
    return _register(_inference, "inference type", name, cls, replace)


def import_plugins(modules: list[str]) -> None:
    """Import user plug-in modules named by a *local* config's `plugins:` field.

    Never call this with names taken from a network request.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise RegistryError(f"plugins: cannot import {module!r}: {exc}") from None
