"""`load_model(spec) -> (model, tokenizer)`: the one way llmrl turns a model spec into weights.

A spec is ``tiny://NAME`` (a model of `llmrl.models.tiny` shipped inside the package), a local
folder written by `save_pretrained`, or a Hugging Face hub id handed to `transformers` as is. One that
starts with ``.``, ``/`` or ``~`` is a path, never a hub id; one like ``runs/demo`` is the folder
where there is one, else a hub id, and when neither has a model the error says both (where the
folder was looked for, what the hub answered) and, for a run folder llmrl makes, the command that
makes it. A hub id loads from the local cache alone while the hub cannot be reached (one quick
request says so, `_unreachable_hub`): huggingface_hub would otherwise retry every file it looks
for, with growing waits, before the same error.

Models with a feature llmrl cannot reproduce exactly between its inference engine and its
trainer are refused here, before their weights load (`check_supported`), rather than after a first
generation or a first training step.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from llmrl.algorithms.varlen import VARLEN
from llmrl.algorithms.varlen import register as register_varlen
from llmrl.config import config_folder_of_missing_spec, training_hint
from llmrl.errors import ModelSpecError, UserError
from llmrl.models.tiny import TINY_MODELS, tiny_model_path
from llmrl.models.upcycle import UPCYCLED_MODELS, upcycled_model_path

TINY_SCHEME = "tiny://"
PATH_STARTS = (".", "/", "~")
"""A spec that starts with one of these is a path, never a hub id."""
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# `name` or `owner/name` with the characters the hub allows; anything else can only be a path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")


def _tiny_names() -> str:
    return ", ".join(TINY_SCHEME + name for name in sorted([*TINY_MODELS, *UPCYCLED_MODELS]))


def _is_plausible_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and ".." not in spec and not spec.endswith((".", "-"))


def resolve_model_spec(spec: str) -> str:
    """The folder or hub id that `spec` names (a tiny model's shipped folder, its checksums verified); one
    that starts like a path (`PATH_STARTS`) is a folder, never a hub id."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"model spec must be a non-empty string, got {spec!r}")
    if spec.startswith(TINY_SCHEME):
        name = spec[len(TINY_SCHEME) :]
        if name in UPCYCLED_MODELS:
            return str(upcycled_model_path(name))
        if name not in TINY_MODELS:
            raise ModelSpecError(f"unknown model spec {spec!r}; valid tiny models: {_tiny_names()}")
        return str(tiny_model_path(name))
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelSpecError(
                f"model spec {spec!r} is a file; expected a folder written by save_pretrained"
            )
        return str(path)
    if spec.startswith(PATH_STARTS):
        raise ModelSpecError(f"model spec {spec!r}: {_missing_folder(spec)}{training_hint(spec)}")
    if not _is_plausible_hub_id(spec):
        advice = (
            training_hint(spec)
            or f"; use a folder written by save_pretrained, a hub id, or one of {_tiny_names()}"
        )
        raise ModelSpecError(
            f"model spec {spec!r}: {_missing_folder(spec)}, and it is not a Hugging Face hub id (owner/name)"
            f"{advice}"
        )
    return spec


def _missing_folder(spec: str) -> str:
    """That there is no folder `spec`, and where it was looked for: a relative one in the working folder
    and, when a config file elsewhere named it, beside that file (`llmrl.config.load_config`)."""
    path = Path(spec).expanduser()
    if path.is_absolute():
        return f"no folder {spec}" + (f" (looked in {path})" if str(path) != spec else "")
    beside = config_folder_of_missing_spec(spec)
    if beside is None or beside.resolve() == Path.cwd().resolve():
        return f"no folder {spec} (looked in the working folder: {path.absolute()})"
    return (
        f"no folder {spec} (looked in the working folder and beside the config: "
        f"{path.absolute()}, {(beside / path).absolute()})"
    )


def _hub_options(source: str) -> dict[str, Any]:
    """`from_pretrained`'s options for the folder or hub id `source`: the local cache alone for a hub id
    while the hub cannot be reached."""
    return {"local_files_only": True} if _offline_reason(source) else {}


def _offline_reason(source: str) -> str | None:
    """Why the hub id `source` loads from the local cache alone, or None (a folder, or a reachable hub)."""
    return None if Path(source).is_dir() else _unreachable_hub()


@functools.cache
def _unreachable_hub() -> str | None:
    """Why the Hugging Face hub cannot be reached (asked once per process, within huggingface_hub's own
    metadata timeout), or None: it answers, or huggingface_hub is offline already (``HF_HUB_OFFLINE``)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return None
    try:  # through huggingface_hub's own client, with its proxies and certificates
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as exc:  # whatever keeps an answer from coming: the hub is out of reach
        return f"{constants.ENDPOINT} cannot be reached: {exc or type(exc).__name__}"
    return None


def _load_error(spec: str, source: str, what: str, exc: OSError) -> ModelSpecError:
    """Why the model `spec` (its folder or hub id: `source`) has no loadable `what`. A hub id the hub
    does not have, or was not asked for, may have been meant as a folder: the error says both."""
    missing = None if Path(source).is_dir() else _missing_from_hub(source, what, exc)
    if missing is None:
        return ModelSpecError(f"model spec {spec!r}: cannot load its {what}: {exc}")
    return ModelSpecError(f"model spec {spec!r}: {_missing_folder(spec)}; {missing}{training_hint(spec)}")


def _missing_from_hub(hub_id: str, what: str, exc: OSError) -> str | None:
    """Why the hub gave no `what` of `hub_id`, where it has no such model or was not asked (offline);
    None for other failures (a gated model, a broken file), which `exc` tells best."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    unreachable = _offline_reason(hub_id)
    if unreachable:
        return f"its {what} is not in the local cache, and {unreachable}"
    if constants.HF_HUB_OFFLINE:
        return f"its {what} is not in the local cache, and the hub is not asked (HF_HUB_OFFLINE is set)"
    # huggingface_hub's error, or transformers' OSError raised from it; a gated model is one the hub has
    error = exc if isinstance(exc, RepositoryNotFoundError) else exc.__cause__
    if isinstance(error, RepositoryNotFoundError) and not isinstance(error, GatedRepoError):
        return f"the hub has no model {hub_id}"
    return None


LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
"""Rotary scalings whose frequencies follow the length of the sequence in the forward pass."""


def check_supported(config: object, attn_implementation: str | None = None) -> None:
    """Raise `ModelSpecError`, naming the feature and the model type, if llmrl cannot serve and train a
    model of `config` with the same numbers (`attn_implementation`: the attention kernel asked for,
    None: the one already in `config`).

    * Rotary embeddings whose frequencies depend on the sequence length (``rope_type`` dynamic or
      longrope): transformers picks them from the longest position of each forward, so keys cached
      while generating keep the frequencies of a shorter sequence than the training forward uses.
    * Attention logit soft-capping (Gemma 2) under ``sdpa``, which has no soft-capping.
    * Bidirectional attention (``use_bidirectional_attention``, embedding models): not a causal LM.
    """
    model_type = getattr(config, "model_type", type(config).__name__)
    for text_config in _text_configs(config):
        for rope in _rope_parameters(text_config):
            if rope.get("rope_type") in LENGTH_DEPENDENT_ROPE:
                raise ModelSpecError(
                    f"model type {model_type!r}: rotary scaling rope_type={rope['rope_type']!r} is not supported "
                    f"(its frequencies change with the sequence length, so generation with a KV cache and a "
                    f"training forward would give different logprobs)"
                )
        implementation = attn_implementation or getattr(text_config, "_attn_implementation", None)
        softcap = getattr(text_config, "attn_logit_softcapping", None)
        if softcap is not None and implementation in ("sdpa", "varlen"):
            raise ModelSpecError(
                f"model type {model_type!r}: attention logit soft-capping (attn_logit_softcapping={softcap}) is not "
                f"supported with attn_implementation='{implementation}', which cannot soft-cap; use attn_implementation='eager'"
            )
        if getattr(text_config, "use_bidirectional_attention", False):
            raise ModelSpecError(
                f"model type {model_type!r}: bidirectional attention (use_bidirectional_attention=True) "
                f"is not supported: llmrl trains causal language models"
            )


def _text_configs(config: object) -> list[object]:
    """`config` and its text model's config, where it has one (multimodal models)."""
    text = getattr(config, "text_config", None)
    return [config] if text is None or text is config else [config, text]


def _rope_parameters(config: object) -> list[dict]:
    """The rotary settings of `config`: one dict, or one per attention kind (Gemma 3's local and global)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if all(isinstance(value, dict) for value in parameters.values()) and parameters:
        return list(parameters.values())
    return [parameters]


def load_tokenizer(spec: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of model `spec`; it always has a pad token (its eos token when it has none)."""
    source = resolve_model_spec(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=trust_remote_code, **_hub_options(source)
        )
    except OSError as exc:  # unreachable hub, unknown repo, or a folder without tokenizer files
        raise _load_error(spec, source, "tokenizer", exc) from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelSpecError(f"model spec {spec!r}: its tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    spec: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    model_class: type = AutoModelForCausalLM,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM (or another `model_class`: a reward model's sequence classifier) and its
    tokenizer; the tokenizer always has a pad token.

    A model with a feature llmrl does not support raises `ModelSpecError` naming it (`check_supported`).

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
    tokenizer = load_tokenizer(spec, trust_remote_code=trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(
            source, trust_remote_code=trust_remote_code, **_hub_options(source)
        )
    except OSError as exc:
        raise _load_error(spec, source, "config", exc) from exc
    check_supported(config, attn_implementation)
    if attn_implementation == "varlen":
        register_varlen()
        attn_implementation = VARLEN
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            model = model_class.from_config(
                config,
                dtype=dtype,
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
            )
    else:
        try:
            model = model_class.from_pretrained(
                source,
                config=config,
                dtype=dtype,
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
                **_hub_options(source),
            )
        except OSError as exc:  # the weights: not in the cache, or gone from the folder
            raise _load_error(spec, source, "weights", exc) from exc
    if model.can_generate() and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model.eval()
    return model, tokenizer


def export_model(spec: str, output_dir: str | Path, *, dtype: str | torch.dtype = "float32") -> Path:
    """Write the model and tokenizer that `spec` names as a plain Hugging Face folder (`llmrl export`)."""
    model, tokenizer = load_model(spec, dtype=dtype)
    return write_model_folder(model, tokenizer, output_dir)


def write_model_folder(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, output_dir: str | Path
) -> Path:
    """`model` and `tokenizer` as a plain Hugging Face folder, which must not exist or be empty."""
    output = Path(output_dir).expanduser()
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"output folder {str(output)!r} must not exist or be empty")
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer in the backward pass (train mode only), non-reentrant: it composes
    with FSDP2's hooks and with inputs that need no gradient. transformers renamed the method in 5.x."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
