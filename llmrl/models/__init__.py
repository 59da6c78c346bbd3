"""Models: `load_model(spec) -> (model, tokenizer)` for ``tiny://...``, local folders and hub ids.

`tiny.py` holds the default model's recipe and checks its build (`tiny://arithmetic`), which ships in
`shipped/`; `tiny_build.py` builds it (docs/models.md).
"""

from llmrl.models.loading import (
    ModelSpecError,
    check_supported,
    export_model,
    load_model,
    load_tokenizer,
    resolve_model_spec,
)
from llmrl.models.tiny import TINY_MODELS, TinyRecipe, tiny_model_path

__all__ = [
    "TINY_MODELS",
    "ModelSpecError",
    "TinyRecipe",
    "check_supported",
    "export_model",
    "load_model",
    "load_tokenizer",
    "resolve_model_spec",
    "tiny_model_path",
]
