"""Weight updates of the embedded engine: new weights read and checked before they wait their turn.

The engine (``engine.py``) applies an update between decode steps; this module turns what
`LocalEngine.update_weights` is given (a state dict, a safetensors/torch file, a folder of them,
or an iterable of bucket dicts) into a `WeightUpdate`, each bucket checked against the names,
shapes and floating-ness of the model's ``state_dict`` as the engine recorded them when it was
built (`served_tensors`): the Llama/Qwen2 decoder may since have released some of the model's
tensors into its fused ones.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from llmrl.inference.interface import Weights
from llmrl.weight_checks import weight_problem


@dataclass(eq=False)
class WeightUpdate:
    buckets: Iterable[dict[str, torch.Tensor]]  # read once, when the update is applied
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class ServedTensor(NamedTuple):
    shape: torch.Size
    floating: bool


def served_tensors(model: torch.nn.Module) -> dict[str, ServedTensor]:
    """What each tensor of `model`'s state dict must be to replace it, by name."""
    return {name: ServedTensor(tensor.shape, tensor.is_floating_point()) for name, tensor in model.state_dict().items()}


def weight_update(served: dict[str, ServedTensor], state_dict_or_path: Weights, version: int) -> WeightUpdate:
    """An update of the tensors `served` describes to `state_dict_or_path`: a whole state dict (or
    file, or folder) is read and checked now, an iterable of buckets bucket by bucket as it is applied."""
    if isinstance(state_dict_or_path, (dict, str, Path)):
        state = state_dict_or_path if isinstance(state_dict_or_path, dict) else _read_state_dict(state_dict_or_path)
        _check_state_dict(served, state)
        return WeightUpdate([state], version)
    return WeightUpdate(_checked(served, state_dict_or_path), version)


def _checked(served: dict[str, ServedTensor], buckets: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for bucket in buckets:
        _check_state_dict(served, bucket)
        yield bucket


def _check_state_dict(served: dict[str, ServedTensor], state: dict[str, Any]) -> None:
    unknown = sorted(k for k in state if k not in served)
    if unknown:
        raise ValueError(f"state_dict: keys the model does not have: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state_dict: {key!r} is a {type(value).__name__}, not a tensor")
        problem = weight_problem(key, value, served[key].shape, floating=served[key].floating)
        if problem:
            raise ValueError(f"state_dict: {problem}")


def _read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors or torch file, or of every such file in a folder (a sharded checkpoint)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))
        if not files:
            raise ValueError(f"state_dict_or_path: no *.safetensors, *.bin or *.pt files in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"state_dict_or_path: {path} is neither a file nor a folder")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(file)))
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state
