"""Models: `load_model(spec) -> (model, tokenizer)` for ``tiny://...``, local folders and hub ids.

`tiny.py` builds the default model (`tiny://arithmetic`), which ships in `shipped/` (docs/models.md).
Its names are re-exported lazily, so that `python -m llmrl.models.tiny` does not find the module
already imported by this package (runpy warns about that, and would run the module twice).
"""

import importlib
from typing import Any

from llmrl.models.loading import (
    ModelSpecError,
    check_supported,
    export_model,
    load_model,
    load_tokenizer,
    resolve_model_spec,
)

_TINY_EXPORTS = ("TINY_MODELS", "TinyRecipe", "build_tiny_model", "tiny_model_path")

__all__ = [
    "ModelSpecError",
    "check_supported",
    "export_model",
    "load_model",
    "load_tokenizer",
    "resolve_model_spec",
    *_TINY_EXPORTS,
]


def __getattr__(name: str) -> Any:
    if name in _TINY_EXPORTS:
        return getattr(importlib.import_module("llmrl.models.tiny"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
