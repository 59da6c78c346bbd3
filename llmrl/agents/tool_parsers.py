"""Tool calls in a model's text: parsers that turn a completion into content and OpenAI `tool_calls`.

A chat template teaches a model one way of writing tool calls; the parser of that way is chosen per
model (`agent_args.tool_parser` of the `openai_agent` environment):

* ``hermes``: Hermes and Qwen2/2.5/3 models, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks after any text (the form their templates render an assistant's tool calls in).

A completion is parsed whole or not at all: when any block is not a JSON object with a ``name``, the
completion is plain content with no tool calls (what vLLM's parsers do too), so the program sees
what the model wrote and its reward can tell a malformed call from a good one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedCompletion:
    content: str | None
    """The text outside the tool-call blocks (None when there is none, as OpenAI sends it)."""
    tool_calls: list[ParsedToolCall]


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedCompletion:
    """Content and ``<tool_call>`` JSON blocks of a Hermes/Qwen-style completion."""
    blocks = _HERMES_BLOCK.findall(text)
    if not blocks:
        return ParsedCompletion(content=text, tool_calls=[])
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return ParsedCompletion(content=text, tool_calls=[])
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or not isinstance(arguments, dict)
        ):
            return ParsedCompletion(content=text, tool_calls=[])
        calls.append(ParsedToolCall(name=call["name"], arguments=arguments))
    content = text[: text.index("<tool_call>")].strip()
    return ParsedCompletion(content=content or None, tool_calls=calls)


TOOL_PARSERS: dict[str, Callable[[str], ParsedCompletion]] = {"hermes": parse_hermes}
"""Parser names a config may give as `tool_parser`."""
