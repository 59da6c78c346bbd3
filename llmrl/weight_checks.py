"""What a tensor must pass before it serves as a model weight.

llmrl's inference engine (and so its server), the vLLM interface before it sends, and llmrl's
transfer backend inside vLLM all apply the same check. It imports only torch, since it also runs in
vLLM's own environment.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
