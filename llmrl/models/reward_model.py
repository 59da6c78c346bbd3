"""Reward models: a sequence classifier with one label that scores prompt + completion, named by a
reward function entry ``{model: PATH_OR_HUB_ID, weight, name, batch, device, dtype}``.

The texts are TRL's (`GRPOTrainer` with a model among its ``reward_funcs``): a chat prompt (a list of
messages) with the completion as the assistant's reply, rendered in the reward model's chat template
when its tokenizer has one; a text prompt, or a tokenizer without a template, concatenated: the prompt
(its messages' contents, one after another) then the completion. The texts of one call (a group, or
a completion with ``batch: completion``) are tokenized together without special tokens, padded on the
right, and each one's score is the model's one logit at its last token that is not padding.

A model loads once per process for each (model, device, dtype) and is shared by every environment that
names it. Calls take turns on it (one forward at a time): a fast tokenizer's padding settings are not
safe to share between threads, and one forward already keeps the device busy.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from llmrl.errors import UserError
from llmrl.models.loading import DTYPES, load_model, resolve_model_spec
from llmrl.rewards.functions import BATCHES, RewardFunction

ENTRY_KEYS: tuple[str, ...] = ("model", "weight", "name", "batch", "device", "dtype")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")


class RewardModel:
    """A loaded reward model, called as a TRL-style reward function: ``model(prompts, completions)``."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
        self.model = model
        self.tokenizer = tokenizer
        self._turn = threading.Lock()

    def texts(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        """What the model reads of each completion (the module docstring says how it is rendered)."""
        return [
            self._text(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)
        ]

    def _text(self, prompt: Any, completion: Any) -> str:
        if isinstance(prompt, str):
            return prompt + completion
        if self.tokenizer.chat_template is not None:
            return self.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        return "".join(message["content"] for message in prompt + completion)

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        texts = self.texts(prompts, completions)
        with self._turn, torch.inference_mode():
            inputs = self.tokenizer(
                texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
            ).to(self.model.device)
            logits = self.model(**inputs).logits  # (B, 1)
        return logits[:, 0].float().tolist()


def resolved_device(device: str) -> str:
    """``auto``: a GPU where torch sees one, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@functools.cache
def _loaded(source: str, device: str, dtype: str) -> RewardModel:
    model, tokenizer = load_model(
        source, dtype=dtype, device=device, model_class=AutoModelForSequenceClassification
    )
    if model.config.num_labels != 1:
        raise UserError(f"{source!r} has {model.config.num_labels} labels; a reward model has one")
    # The score is read at the last token that is not padding, found by the config's pad token id.
    model.config.pad_token_id = tokenizer.pad_token_id
    return RewardModel(model, tokenizer)


def load_reward_model(spec: str, *, device: str = "auto", dtype: str = "float32") -> RewardModel:
    """The reward model `spec` names on `device` in `dtype`, loaded once per process."""
    return _loaded(resolve_model_spec(spec), resolved_device(device), dtype)


def reward_model_function(entry: Mapping[str, Any], where: str) -> RewardFunction:
    """The reward function of an entry ``{model, weight, name, batch, device, dtype}``; `where` prefixes
    errors. Its name defaults to the model folder's or hub id's last part."""
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; valid keys for a model: {', '.join(ENTRY_KEYS)}")
    spec, device, dtype, batch = _checked(entry, where)
    try:
        model = load_reward_model(spec, device=device, dtype=dtype)
    except UserError as exc:
        raise ValueError(f"{where}.model: {exc}") from None
    named = {**entry, "name": entry.get("name") or Path(spec.rstrip("/")).name}
    return RewardFunction.named(model, named, where, style="trl", batch=batch)


def _checked(entry: Mapping[str, Any], where: str) -> tuple[str, str, str, str]:
    """The entry's model, device, dtype and batch, defaults filled in."""
    spec = entry.get("model")
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{where}.model: expected a model folder or hub id, got {spec!r}")
    values = []
    for key, default, allowed in (
        ("device", "auto", DEVICES),
        ("dtype", "float32", tuple(DTYPES)),
        ("batch", "group", BATCHES),
    ):
        value = entry.get(key, default)
        if value not in allowed:
            raise ValueError(f"{where}.{key}: expected one of {list(allowed)}, got {value!r}")
        values.append(value)
    device, dtype, batch = values
    return spec, device, dtype, batch


def reward_models_bytes(entries: Iterable[Mapping[str, Any]], device: str) -> int:
    """The weights of the reward models `entries` name that load on `device` (the trainer's: ``cpu`` or
    ``cuda``), each distinct one once, from their shapes alone."""
    models = {
        (resolve_model_spec(entry["model"]), entry.get("dtype", "float32"))
        for entry in entries
        if resolved_device(entry.get("device", "auto")) == device
    }
    total = 0
    for source, dtype in models:
        model, _ = load_model(source, device="meta", model_class=AutoModelForSequenceClassification)
        total += sum(p.numel() for p in model.parameters()) * DTYPES[dtype].itemsize
    return total
