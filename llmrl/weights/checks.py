"""What a tensor must pass before it serves as a model weight, and a whole update before it is sent.

The embedded engine (and so llmrl's server), the vLLM interface before it sends, and llmrl's
transfer backend inside vLLM all apply the same checks. This module imports only torch, since it
also runs in vLLM's own environment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

Manifest = dict[str, dict[str, Any]]
"""``{name: {"dtype", "shape"}}`` of every tensor of a served checkpoint (read from its file headers)."""


def weight_problem(name: str, tensor: torch.Tensor, shape: Sequence[int], *, floating: bool = True) -> str:
    """Why `tensor` cannot serve as `name`, whose served tensor has `shape` and is (or, with
    `floating` False, is not) floating point; '' when it can.

    Reads every value once: a single NaN or Inf weight would make every request fail.
    """
    if tuple(tensor.shape) != tuple(shape):
        return f"{name!r} has shape {list(tensor.shape)}, the served model's is {list(shape)}"
    if tensor.is_floating_point() != floating:
        kind = "floating point" if floating else "not floating point"
        return f"{name!r} has dtype {tensor.dtype}, the served model's is {kind}"
    if floating and not bool(torch.isfinite(tensor).all()):
        return f"{name!r} has non-finite values (NaN or Inf)"
    return ""


# -- against a model in memory (the embedded engine) ---------------------------------------------


class ServedTensor(NamedTuple):
    shape: torch.Size
    floating: bool


def served_tensors(model: torch.nn.Module) -> dict[str, ServedTensor]:
    """What each tensor of `model`'s state dict must be to replace it, by name."""
    return {
        name: ServedTensor(tensor.shape, tensor.is_floating_point())
        for name, tensor in model.state_dict().items()
    }


def check_state_dict(served: dict[str, ServedTensor], state: dict[str, Any]) -> None:
    """Refuse (ValueError) a state dict, or part of one, that cannot replace tensors of `served`."""
    unknown = sorted(k for k in state if k not in served)
    if unknown:
        raise ValueError(
            f"state_dict: keys the model does not have: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state_dict: {key!r} is a {type(value).__name__}, not a tensor")
        problem = weight_problem(key, value, served[key].shape, floating=served[key].floating)
        if problem:
            raise ValueError(f"state_dict: {problem}")


# -- against a served checkpoint's manifest (vLLM) ------------------------------------------------


def check_weights(
    state: dict[str, torch.Tensor], manifest: Manifest, server: str, *, complete: bool = True
) -> None:
    """Refuse (ValueError) a state dict that does not match the served checkpoint tensor for tensor;
    without `complete`, a bucket of one (the missing names are `check_names`' to find at the end)."""
    check_names(set(state), manifest, server, complete=complete)
    for name, tensor in state.items():
        problem = weight_problem(name, tensor, manifest[name]["shape"])
        if problem:
            raise ValueError(f"weights for {server}: {problem}")


def check_names(names: set[str], manifest: Manifest, server: str, *, complete: bool = True) -> None:
    """Refuse (ValueError) names the served checkpoint lacks and, when `complete`, any of its tensors
    missing."""
    unknown = sorted(names - set(manifest))
    missing = sorted(set(manifest) - names) if complete else []
    if unknown or missing:
        raise ValueError(
            f"weights for {server}: {len(unknown)} name(s) the served checkpoint lacks {unknown[:3]} and "
            f"{len(missing)} of its tensor(s) missing {missing[:3]}; a sync sends the whole checkpoint"
        )


def manifest_tensors(manifest: Manifest) -> dict[str, ServedTensor]:
    """What each tensor of a served checkpoint is, as `served_tensors` says of a model in memory
    (what LoRA adapters are checked against)."""
    return {
        name: ServedTensor(torch.Size(entry["shape"]), entry["dtype"].startswith(("F", "BF")))
        for name, entry in manifest.items()
    }


def manifest_problem(name: str, tensor: torch.Tensor, manifest: Manifest) -> str:
    """What is wrong with sending `tensor` as `name` to a server holding `manifest` ('' if nothing)."""
    expected = manifest.get(name)
    if expected is None:
        return f"{name!r} is not a tensor of the served checkpoint"
    return weight_problem(name, tensor, expected["shape"])
