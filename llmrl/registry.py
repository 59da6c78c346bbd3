"""Allowlisted names for agents and inference interfaces.

Configs name components by short registry names (`agent_type: arithmetic`), never by import path,
so a config that arrives over the network cannot make a process import arbitrary code. The
built-in entries are resolved lazily (importing an agent pulls in its dependencies only when it is
used). A *local* config may load user plug-ins through its explicit `plugins:` field: each listed
module is imported and calls `register_agent` / `register_inference` itself, and its functions
can be named as ``module:function`` (reward functions); no other module's can. A config built in
Python (`llmrl.train`) may hold an agent class itself in place of its name.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any

from llmrl.errors import UserError, shown_path

_BUILTIN_AGENTS: dict[str, str] = {
    "arithmetic": "llmrl.envs.arithmetic:ArithmeticAgent",
    "countdown": "llmrl.envs.countdown:CountdownAgent",
    "math": "llmrl.envs.math:MathAgent",
    "gsm8k": "llmrl.envs.math:GSM8KAgent",
    "code": "llmrl.envs.code:CodeAgent",
    "reasoning_gym": "llmrl.envs.reasoning_gym:ReasoningGymAgent",
    "dataset": "llmrl.agents.dataset:DatasetAgent",
    "remote": "llmrl.agents.remote:RemoteAgent",
    "openai_agent": "llmrl.agents.openai_agent:OpenAIAgent",
    "openenv": "llmrl.envs.openenv_env:OpenEnvAgent",
    "verifiers": "llmrl.envs.verifiers_env:VerifiersAgent",
}

_BUILTIN_INFERENCE: dict[str, str] = {
    "local": "llmrl.inference.engine:LocalEngine",
    "openai": "llmrl.inference.openai:OpenAIInterface",
    "vllm": "llmrl.inference.vllm:VLLMInterface",
}

_BUILTIN_FUNCTIONS: dict[str, str] = {
    name: f"llmrl.rewards.scorers:{name}"
    for name in ("default_compute_score", "gsm8k_strict", "gsm8k_flexible", "math_boxed", "math_dapo")
}
"""Reward functions a config may name without a plug-in (verl-style scorers)."""

_agents: dict[str, str | type] = dict(_BUILTIN_AGENTS)
_plugin_modules: set[str] = set()
_inference: dict[str, str | type] = dict(_BUILTIN_INFERENCE)


class RegistryError(UserError):
    """An unknown or unavailable registry name."""


def _resolve(table: dict[str, str | type], kind: str, name: str) -> type:
    _refuse_description(name, f"a registered {kind}")
    if not isinstance(name, str) or name not in table:
        valid = ", ".join(sorted(table))
        hint = (
            " Import paths are not accepted; register plug-ins via `plugins:` in a local config."
            if (isinstance(name, str) and ("." in name or ":" in name))
            else ""
        )
        raise RegistryError(f"unknown {kind} {name!r}; valid names: {valid}.{hint}")
    entry = table[name]
    if isinstance(entry, type):
        return entry
    module_name, _, attr = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise RegistryError(
                f"{kind} {name!r} is registered but not available in this version of llmrl"
            ) from None
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


def get_agent_class(name: str | type) -> type:
    """The agent class registered under `name`, or `name` itself when a config built in Python holds the
    class; unknown names list the valid ones."""
    if isinstance(name, type):
        return name
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

    An entry is a module name (``my_rewards``, ``mypackage.envs``) or the path of a ``.py`` file,
    imported under its file name (``examples/my_rewards.py`` is the module ``my_rewards``; a
    package's ``NAME/__init__.py`` is the package ``NAME``). A module name is imported from the
    import path, else from the working directory (which the ``llmrl`` command does not put on the
    import path). Never call this with names taken from a network request.
    """
    for module in modules:
        try:
            name = _import_file(Path(module)) if module.endswith(".py") else _import_module(module)
        except (ImportError, OSError) as exc:
            raise RegistryError(f"plugins: cannot import {module!r}: {exc}") from None
        except Exception as exc:  # the plug-in's own code raised
            raise RegistryError(f"plugins: {_failure_in_plugin(module, exc)}") from None
        _plugin_modules.add(name)


def _failure_in_plugin(module: str, exc: Exception) -> str:
    """``my_rewards.py:3: NameError: ...``: the last line of the plug-in's file on the way to the error
    (whatever it called raised), or the line that does not compile."""
    if isinstance(exc, SyntaxError):  # raised compiling the file: it has no frame
        return f"{shown_path(exc.filename or module)}:{exc.lineno}: SyntaxError: {exc.msg}"
    frames = [(frame.f_code.co_filename, line) for frame, line in traceback.walk_tb(exc.__traceback__)]
    # The plug-in's file is the first one the import ran that is not the import machinery.
    plugin = next(
        (
            file
            for file, _ in frames
            if not file.startswith("<") and Path(file).parent not in _IMPORT_MACHINERY
        ),
        None,
    )
    if plugin is None:
        return f"{module}: {type(exc).__name__}: {exc}"
    line = [line for file, line in frames if file == plugin][-1]
    return f"{shown_path(plugin)}:{line}: {type(exc).__name__}: {exc}"


_IMPORT_MACHINERY = (Path(__file__).parent, Path(importlib.__file__).parent)
"""Where the frames of an import that are not the plug-in's lie: llmrl's and importlib's folders."""


def _import_module(name: str) -> str:
    try:
        return importlib.import_module(name).__name__
    except ModuleNotFoundError as exc:
        top = name.partition(".")[0]
        spec = importlib.machinery.PathFinder.find_spec(top, [str(Path.cwd())])
        if exc.name != top or spec is None:
            raise
    _execute(spec)
    return importlib.import_module(name).__name__


def _import_file(path: Path) -> str:
    if not path.is_file():
        raise ImportError(f"no such file: {path}")
    package = path.name == "__init__.py"
    name = path.parent.resolve().name if package else path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path.resolve():
        return name
    locations = [str(path.parent)] if package else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=locations)
    assert spec is not None
    _execute(spec)
    return name


def _execute(spec: importlib.machinery.ModuleSpec) -> None:
    """Import the module `spec` finds, as `spec.name` (replacing a module of that name)."""
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise


def resolve_function(spec: str) -> Any:
    """The function `spec` names: ``module:function`` from an imported plug-in, or a built-in's name."""
    _refuse_description(spec, "a function as module:function")
    if not isinstance(spec, str) or not spec:
        raise RegistryError(f"expected a function name such as my_rewards:accuracy, got {spec!r}")
    module_name, colon, attr = spec.rpartition(":")
    if not colon:
        if spec not in _BUILTIN_FUNCTIONS:
            raise RegistryError(
                f"{spec!r} is not a built-in reward function ({', '.join(sorted(_BUILTIN_FUNCTIONS))}); "
                "name a plug-in's function as module:function"
            )
        module_name, _, attr = _BUILTIN_FUNCTIONS[spec].partition(":")
    elif not any(module_name == p or module_name.startswith(p + ".") for p in _plugin_modules):
        raise RegistryError(
            f"{spec!r}: module {module_name!r} is not a plug-in of this config; list it under plugins: "
            f"(imported so far: {sorted(_plugin_modules) or 'none'})"
        )
    function = getattr(importlib.import_module(module_name), attr, None)
    if not callable(function):
        raise RegistryError(f"{spec!r}: module {module_name!r} has no function {attr!r}")
    return function


def _refuse_description(name: Any, expected: str) -> None:
    """A config saved from a run built in Python writes its objects as ``<...>`` descriptions
    (`llmrl.config.describe_python_object`), which name nothing a file can."""
    if isinstance(name, str) and name.startswith("<") and name.endswith(">"):
        raise RegistryError(
            f"{name} stands for an object a run was given in Python (llmrl.train); pass the object again, "
            f"or name {expected} in a config file"
        )
