"""``--set section.field=value`` overrides: parsing one, and applying a list of them to a config's data."""

from __future__ import annotations

import re
from typing import Any

import yaml

from llmrl.config.errors import ConfigError

_LIST_INDEX = re.compile(r"\[(\d+)\]")
"""``environments[0]``: the way errors name a list item, accepted in keys as ``environments.0``."""


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into (["a", "b", "c"], parsed YAML value); ``a[0].b`` is ``a.0.b``."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected key=value, e.g. training.lr=1e-5")
    path = _LIST_INDEX.sub(r".\1", key.strip()).split(".")
    if any(not part for part in path):
        raise ConfigError(f"--set {assignment!r}: empty component in key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {assignment!r}: value is not valid YAML: {exc}") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with each ``key=value`` override applied (lists indexed by number)."""
    data = copy_containers(data)
    for assignment in overrides:
        path, value = parse_override(assignment)
        node: Any = data
        for depth, part in enumerate(path[:-1]):
            where = ".".join(path[: depth + 1])
            if isinstance(node, list):
                node = node[_list_index(part, node, where, assignment)]
            else:
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
                if not isinstance(child, (dict, list)):
                    raise ConfigError(f"--set {assignment!r}: {where} is a value, not a section")
                node = child
        last = path[-1]
        if isinstance(node, list):
            node[_list_index(last, node, ".".join(path), assignment)] = value
        else:
            node[last] = value
    return data


def copy_containers(value: Any) -> Any:
    """A copy of the mappings and lists of `value` that shares everything else: the objects a config built
    in Python holds (a function, a dataset) stay the objects themselves."""
    if isinstance(value, dict):
        return {key: copy_containers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [copy_containers(item) for item in value]
    return value


def _list_index(part: str, node: list[Any], where: str, assignment: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"--set {assignment!r}: {where} needs an index 0..{len(node) - 1}")
    return int(part)
