"""`load_model(spec) -> (model, tokenizer)`: the one way llmrl turns a model spec into weights.

A spec is ``tiny://NAME`` (the embedded model of `llmrl.models.tiny`, built on first use), a local
folder written by `save_pretrained`, or a Hugging Face hub id handed to `transformers` as is.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

TINY_SCHEME = "tiny://"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# `name` or `owner/name` with the characters the hub allows; anything else can only be a path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")


def _is_plausible_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and ".." not in spec and not spec.endswith((".", "-"))


def resolve_model_spec(spec: str) -> str:
    """The folder or hub id that `spec` names; builds the tiny model if the spec asks for it."""
    from llmrl.models.tiny import TINY_MODELS, tiny_model_path  # here: see llmrl/models/__init__.py

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}")
    if spec.startswith(TINY_SCHEME):
        return str(tiny_model_path(spec[len(TINY_SCHEME) :]))
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"model spec {spec!r} is a file; expected a folder written by save_pretrained")
        return str(path)
    if not _is_plausible_hub_id(spec):
        raise ValueError(
            f"model spec {spec!r}: no such local folder, and it is not a Hugging Face hub id (owner/name); "
            f"use a folder written by save_pretrained, a hub id, or one of "
            f"{', '.join(TINY_SCHEME + n for n in sorted(TINY_MODELS))}"
        )
    return spec


def load_model(
    spec: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer; the tokenizer always has a pad token.

    The model comes back in eval mode on `device`. On the ``meta`` device it is built from its
    config alone, its weights never read (a rank that receives its shards from another). Tokenizers
    without a pad token get their eos token as pad (generation masks padding by attention mask, so
    the two never get confused).
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    elif dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    source = resolve_model_spec(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as exc:  # unreachable hub, unknown repo, or a folder without tokenizer files
        raise ValueError(f"model spec {spec!r}: cannot load its tokenizer: {exc}") from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"model spec {spec!r}: its tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    if torch.device(device).type == "meta":
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model.eval()
    return model, tokenizer


def export_model(spec: str, output_dir: str | Path, *, dtype: str | torch.dtype = "float32") -> Path:
    """Write the model and tokenizer that `spec` names as a plain Hugging Face folder (`llmrl export`)."""
    output = Path(output_dir).expanduser()
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"output folder {str(output)!r} must not exist or be empty")
    model, tokenizer = load_model(spec, dtype=dtype)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output
