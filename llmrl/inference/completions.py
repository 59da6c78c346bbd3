"""What llmrl keeps of a completion another engine made: shared by the readers of an OpenAI-compatible
server's choices (`openai`) and of colocated vLLM's outputs (`vllm.colocated`)."""

from __future__ import annotations

from typing import Any

from llmrl.types import FinishReason


def parse_finish_reason(reason: Any) -> FinishReason:
    """A server's finish reason as llmrl's: `length` and `abort` as they are, anything else `stop`."""
    return reason if reason in ("length", "abort") else "stop"
