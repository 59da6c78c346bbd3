"""`ConfigError`, and how pydantic's validation errors read as one: a line per bad field that names its
dotted path (``training.lr: expected a number, got 'fast'``) and the file it came from."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from llmrl.config.sections import section_type
from llmrl.errors import UserError


class ConfigError(UserError):
    """A config file or override is invalid; the message names every bad field."""


_EXPECTED = {
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "int_parsing": "expected an integer",
    "int_type": "expected an integer",
    "int_from_float": "expected an integer",
    "bool_parsing": "expected true or false",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
}


def _dotted(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or "<root>"


def _known_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names valid at `loc` (the parent of an unknown key), for 'did you mean' hints."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        nested, _ = section_type(field.annotation)
        if nested is None:
            return []
        model = nested
    return list(model.model_fields)


def _describe(error: dict[str, Any], model: type[BaseModel]) -> str:
    path = _dotted(error["loc"])
    kind = error["type"]
    given = error.get("input")
    if kind == "extra_forbidden":
        parent = error["loc"][:-1]
        known = _known_fields(model, parent)
        hint = difflib.get_close_matches(str(error["loc"][-1]), known, n=1)
        message = f"{path}: unknown key"
        if hint:
            message += f" (did you mean '{_dotted((*parent, hint[0]))}'?)"
        elif known:
            message += f"; valid keys here: {', '.join(known)}"
        return message
    if kind == "missing":
        return f"{path}: required field is missing"
    if kind in _EXPECTED:
        return f"{path}: {_EXPECTED[kind]}, got {given!r}"
    if kind == "literal_error":
        return f"{path}: expected one of {error['ctx']['expected']}, got {given!r}"
    message = error["msg"].removeprefix("Value error, ")
    if path == "<root>":
        return message
    return (
        f"{path}: {message}, got {given!r}"
        if "input" in error and not isinstance(given, dict)
        else f"{path}: {message}"
    )


def raise_config_error(exc: ValidationError, source: str | None, model: type[BaseModel]) -> None:
    where = f" (in {source})" if source else ""
    lines = [_describe(e, model) + where for e in exc.errors()]
    raise ConfigError("\n".join(lines)) from None
