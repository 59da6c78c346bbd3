"""The configuration reference, docs/configuration.md: every section and field with its default and
docstring (``python -m llmrl.config`` prints it)."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from llmrl.config.loading import AGENT_INPUT_PATHS
from llmrl.config.run import RunConfig
from llmrl.config.sections import section_type


def reference_markdown() -> str:
    """docs/configuration.md: every section and field with its type, default and docstring."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from llmrl/config/ by `python -m llmrl.config > docs/configuration.md`. -->",
        "",
        "A run is one YAML file; every field below can also be set with `--set section.field=value`",
        "(list items by number: `--set environments.0.agent_args.digits=3`, or `environments[0]`).",
        "`llmrl config show CONFIG` prints a config with all defaults filled in. From Python,",
        "`llmrl.train(config)` takes a file, a mapping or a `RunConfig` (docs/python_api.md).",
        "",
        "Relative paths of the files a run reads (`plugins`, `model.spec`, `distillation.teacher`,",
        "`inference.vllm.python`, and an",
        f"environment's {', '.join(f'`{name}`' for name in AGENT_INPUT_PATHS)}) resolve against the config",
        "file's folder when the file exists there, otherwise against the working directory. The folders a",
        "run writes (`run_dir`, `inference.weights_dir`) are relative to the working directory.",
    ]
    pending: list[tuple[str, type[BaseModel], str | None]] = [("top level", RunConfig, None)]
    while pending:
        title, model, description = pending.pop(0)
        lines += ["", f"## {title}", ""]
        if description:
            lines += [_one_line(description), ""]
        lines += ["| field | default | description |", "|---|---|---|"]
        prefix = "" if model is RunConfig else title.strip("`") + "."
        for name, field in model.model_fields.items():
            nested, is_list = section_type(field.annotation)
            if nested is None or is_list or field.default is None:  # an optional section gets a row too
                lines.append(f"| `{name}` | {_default_text(field)} | {_one_line(field.description)} |")
            if nested is not None:
                pending.append((f"`{prefix}{name}{'[]' if is_list else ''}`", nested, field.description))
    return "\n".join(lines) + "\n"


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_defaults=True) or "defaults"
        return f"`{value}`"
    return f"`{yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}`"
