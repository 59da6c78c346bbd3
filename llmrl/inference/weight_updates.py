"""Weight updates of the embedded engine: new weights read and checked before they wait their turn.

The engine (``engine.py``) applies an update between decode steps; this module turns what
`LocalEngine.update_weights` is given (a state dict, a safetensors/torch file, a folder of them,
or an iterable of bucket dicts) into a `WeightUpdate`, each bucket checked against the model's own
``state_dict`` names and shapes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmrl.inference.interface import Weights
from llmrl.weight_checks import weight_problem


@dataclass(eq=False)
class WeightUpdate:
    buckets: Iterable[dict[str, torch.Tensor]]  # read once, when the update is applied
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def weight_update(model: torch.nn.Module, state_dict_or_path: Weights, version: int) -> WeightUpdate:
    """An update of `model` to `state_dict_or_path`: a whole state dict (or file, or folder) is
    read and checked now, an iterable of buckets bucket by bucket as it is applied."""
    if isinstance(state_dict_or_path, (dict, str, Path)):
        state = state_dict_or_path if isinstance(state_dict_or_path, dict) else _read_state_dict(state_dict_or_path)
        _check_state_dict(model, state)
        return WeightUpdate([state], version)
    return WeightUpdate(_checked(model, state_dict_or_path), version)


def _checked(model: torch.nn.Module, buckets: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for bucket in buckets:
        _check_state_dict(model, bucket)
        yield bucket


def _check_state_dict(model: torch.nn.Module, state: dict[str, Any]) -> None:
    own = model.state_dict()
    unknown = sorted(k for k in state if k not in own)
    if unknown:
        raise ValueError(f"state_dict: keys the model does not have: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state_dict: {key!r} is a {type(value).__name__}, not a tensor")
        problem = weight_problem(key, value, own[key].shape, floating=own[key].is_floating_point())
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
