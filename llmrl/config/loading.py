"""Reading a config (a YAML file, the built-in demo, or a mapping) into a `RunConfig`, with paths found
beside the file, and writing one back as YAML."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from llmrl.config.errors import ConfigError, raise_config_error
from llmrl.config.overrides import apply_overrides, copy_containers
from llmrl.config.run import RunConfig
from llmrl.config.sections import is_python_object_description
from llmrl.errors import shown_path

DEMO_CONFIG = Path(__file__).parent.with_name("demo.yaml")
"""The built-in demo's config file, what ``llmrl train`` runs when given none (examples/arithmetic.yaml
links to it)."""
EXAMPLES = Path(__file__).parents[2] / "examples"
"""The examples' config files, in a source checkout (an installed package has none)."""

_CONFIG_FOLDERS_OF_MISSING_SPECS: dict[str, Path] = {}
"""Each relative `model.spec` or `distillation.teacher` that is a folder neither in the working folder
nor beside the config file that named it last, with that file's folder: the error of such a spec,
which only its loading raises (it may be a hub id), says where it was looked for."""


def demo_config() -> RunConfig:
    """The built-in demo (`DEMO_CONFIG`): the tiny model learns 2-digit addition with GRPO."""
    return load_config(None)


def config_from_dict(data: dict[str, Any], source: str | None = None) -> RunConfig:
    """Validate a plain mapping into a RunConfig; errors name each bad field and `source`."""
    if not isinstance(data, dict):
        where = f" (in {source})" if source else ""
        raise ConfigError(f"<root>: expected a mapping of sections, got {type(data).__name__}{where}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise_config_error(exc, source, RunConfig)
        raise AssertionError("unreachable") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or the built-in demo when `path` is None) and apply ``--set`` overrides."""
    source = "built-in demo config" if path is None else str(path)
    path = DEMO_CONFIG if path is None else Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if isinstance(data, dict):
        data = _found_beside(data, path.parent)
        _remember_missing_specs(data, path.parent)
    if overrides:
        if not isinstance(data, dict):
            raise ConfigError(f"<root>: expected a mapping of sections (in {source})")
        data = apply_overrides(data, overrides)
        source += " with --set overrides"
    return config_from_dict(data, source)


AGENT_INPUT_PATHS = ("path", "data_files", "eval_data_files", "chat_template")
"""The `agent_args` that name files an agent reads (a hub dataset's `path` may also be a local folder)."""


def _found_beside(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """`data` with the relative input paths that exist in `folder` (the config file's) made paths from
    the working directory; the others stay relative to the working directory. Output folders (run_dir,
    inference.weights_dir) are left alone."""
    if folder.resolve() == Path.cwd().resolve():
        return data

    def located(value: Any) -> Any:
        if isinstance(value, list):
            return [located(item) for item in value]
        if isinstance(value, str) and value and not Path(value).is_absolute() and (folder / value).exists():
            return str(folder / value)
        return value

    def located_plugin(entry: Any) -> Any:
        if not isinstance(entry, str) or entry.endswith(".py"):
            return located(entry)
        if not entry.isidentifier():  # a dotted module name: from the import path or the working directory
            return entry
        for candidate in (folder / f"{entry}.py", folder / entry / "__init__.py"):
            if candidate.is_file():
                return str(candidate)
        return entry

    data = copy_containers(data)
    if isinstance(data.get("plugins"), list):
        data["plugins"] = [located_plugin(entry) for entry in data["plugins"]]
    model = data.get("model")
    if isinstance(model, dict) and "spec" in model:
        model["spec"] = located(model["spec"])
    distillation = data.get("distillation")
    if isinstance(distillation, dict) and "teacher" in distillation:
        distillation["teacher"] = located(distillation["teacher"])
    inference = data.get("inference")
    vllm = inference.get("vllm") if isinstance(inference, dict) else None
    if isinstance(vllm, dict) and "python" in vllm:
        vllm["python"] = located(vllm["python"])
    for environment in data.get("environments") or []:
        arguments = environment.get("agent_args") if isinstance(environment, dict) else None
        if isinstance(arguments, dict):
            for key in AGENT_INPUT_PATHS:
                if key in arguments:
                    arguments[key] = located(arguments[key])
    return data


def _remember_missing_specs(data: dict[str, Any], folder: Path) -> None:
    """Note `folder`, the config file's, for each relative model spec of `data` found in no folder (a
    ``tiny://`` spec names no folder)."""
    for section, key in ((data.get("model"), "spec"), (data.get("distillation"), "teacher")):
        spec = section.get(key) if isinstance(section, dict) else None
        if not isinstance(spec, str) or "://" in spec or Path(spec).expanduser().is_absolute():
            continue
        if not Path(spec).exists():
            _CONFIG_FOLDERS_OF_MISSING_SPECS[spec] = folder


def config_folder_of_missing_spec(spec: str) -> Path | None:
    """The folder of the config file that last named the relative model spec `spec`, which is a folder
    neither there nor in the working folder, if one did."""
    return _CONFIG_FOLDERS_OF_MISSING_SPECS.get(spec)


def training_hint(folder: str | Path) -> str:
    """``; run `llmrl train ...` first`` where the run of that command writes `folder` (the demo's run
    folder or an example's, or a folder inside one), else "": how to make a run folder a spec names."""
    target = Path(os.path.abspath(Path(folder).expanduser()))
    commands = [(DEMO_CONFIG, "llmrl train")]
    commands += [(path, f"llmrl train {shown_path(str(path))}") for path in sorted(EXAMPLES.glob("*.yaml"))]
    for config_file, command in commands:
        data = yaml.safe_load(config_file.read_text())
        run_dir = data.get("run_dir") if isinstance(data, dict) else None
        if isinstance(run_dir, str) and target.is_relative_to(os.path.abspath(run_dir)):
            return f"; run `{command}` first"
    return ""


def dump_config(config: RunConfig) -> str:
    """The fully resolved config as YAML (every field, defaults included). A config built in Python
    writes its objects' descriptions (`describe_python_object`), and says so in a first comment."""
    data = config.model_dump(mode="json")
    text = yaml.safe_dump(data, sort_keys=False)
    if not _holds_python_objects(data):
        return text
    return (
        "# Built in Python (llmrl.train): each value written <...> stands for an object the run was given,\n"
        "# so this file does not load as it is; the same Python call resumes the run.\n" + text
    )


def _holds_python_objects(data: Any) -> bool:
    if isinstance(data, dict):
        return any(_holds_python_objects(value) for value in data.values())
    if isinstance(data, list):
        return any(_holds_python_objects(value) for value in data)
    return is_python_object_description(data)
