"""The base of every config section, and how a saved config writes the Python objects that a config
built in Python holds in place of names."""

from __future__ import annotations

from typing import Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict

PYTHON_OBJECT_PREFIXES = ("<python object: ", "<datasets.")
"""How the descriptions `describe_python_object` writes begin."""


def describe_python_object(value: Any) -> str:
    """How a saved config writes an object a config built in Python holds in place of a name: a
    `datasets.Dataset` by its size and fingerprint (a hash of its content), anything else by its
    ``module:qualname`` (an instance's: its class's). Two runs whose objects have the same
    descriptions count as the same config when one resumes the other."""
    if hasattr(value, "_fingerprint") and hasattr(value, "num_rows"):
        return f"<datasets.{type(value).__name__}: {value.num_rows:,} rows, fingerprint {value._fingerprint}>"
    named = value if hasattr(value, "__qualname__") else type(value)
    instance = "" if named is value else " instance"
    return f"<python object: {named.__module__}:{named.__qualname__}{instance}>"


def is_python_object_description(value: Any) -> bool:
    """Whether `value` is what `describe_python_object` writes (a saved config read back as a config)."""
    return isinstance(value, str) and value.startswith(PYTHON_OBJECT_PREFIXES) and value.endswith(">")


class Section(BaseModel):
    """Base of all config sections: unknown keys are errors; field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


def section_type(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field nests (directly, as list items or optionally), and whether it is a list."""
    options = [a for a in get_args(annotation) if a is not type(None)]
    if type(None) in get_args(annotation) and len(options) == 1:
        annotation = options[0]
    is_list = get_origin(annotation) is list
    if is_list:
        annotation = get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, is_list
    return None, False
