"""Weights in buckets: how a state dict is split, serialised as safetensors, and read back.

A bucket holds whole decoder layers, so that fused pieces (q/k/v, gate/up) always travel together.
A trainer gathering sharded weights produces them bucket by bucket; the vLLM transports send one
per request (its bytes, or the path of a file both sides read). This module imports only torch and
safetensors, since llmrl's transfer backend inside vLLM reads what it writes.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TRANSFER_BACKEND = "llmrl"
"""The name of llmrl's weight-transfer backend inside vLLM (`vllm_worker`), which reads these buckets."""


def weight_buckets(names: list[str], sizes: dict[str, int], bucket_bytes: int) -> list[list[str]]:
    """Split `names` (in order) into buckets of at most `bucket_bytes`, never splitting a decoder
    layer, so that fused pieces (q/k/v, gate/up) always travel together: a layer (or other tensor)
    larger than `bucket_bytes` gets a bucket of its own."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(layer_key(name), []).append(name)
    buckets: list[list[str]] = []
    size = 0
    for group in groups.values():
        group_size = sum(sizes[n] for n in group)
        if not buckets or size + group_size > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].extend(group)
        size += group_size
    return [b for b in buckets if b]


def layer_key(name: str) -> str:
    """``model.layers.3`` for every tensor of layer 3; the name itself for the rest."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def tensor_bytes(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """The size in bytes of each tensor of `state`, by name (what `weight_buckets` weighs)."""
    return {name: tensor.numel() * tensor.element_size() for name, tensor in state.items()}


@dataclass
class Bucket:
    """Tensors sent in one update request: the safetensors bytes, or the file holding them."""

    names: list[str]
    data: bytes | None = None
    path: Path | None = None

    def update_info(self) -> dict[str, Any]:
        """The bucket as llmrl's transfer backend inside vLLM takes it (base64 bytes or a path)."""
        if self.path is not None:
            return {"names": self.names, "path": str(self.path)}
        assert self.data is not None
        return {"names": self.names, "data": base64.b64encode(self.data).decode()}


def serialised_buckets(
    state: dict[str, torch.Tensor],
    bucket_bytes: int,
    *,
    folder: Path | None = None,
    prefix: str = "",
    first_index: int = 0,
) -> list[Bucket]:
    """`state` serialised in buckets of at most `bucket_bytes`, numbered from `first_index`: in
    memory, or as files ``{prefix}bucket{index}.safetensors`` in `folder` when one is given."""
    from safetensors.torch import save, save_file

    buckets = []
    for index, names in enumerate(
        weight_buckets(list(state), tensor_bytes(state), bucket_bytes), first_index
    ):
        tensors = safetensors_ready({name: state[name] for name in names})
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{prefix}bucket{index}.safetensors"
            save_file(tensors, str(path))
            buckets.append(Bucket(names, path=path))
        else:
            buckets.append(Bucket(names, data=save(tensors)))
    return buckets


def delete_bucket_files(buckets: Iterable[Bucket]) -> None:
    for bucket in buckets:
        if bucket.path is not None:
            bucket.path.unlink(missing_ok=True)


def safetensors_ready(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`state` as safetensors can write it: CPU, contiguous, and tensors that share memory (tied
    weights, which safetensors refuses to write) copied apart."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state_dict: {key!r} is a {type(value).__name__}, not a tensor")
        tensor = value.detach().to("cpu").contiguous()
        if tensor.untyped_storage().data_ptr() in storages:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[key] = tensor
    return tensors


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors or torch file, or of every such file in a folder (a sharded checkpoint)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))
        if not files:
            raise ValueError(f"weights: no *.safetensors, *.bin or *.pt files in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"weights: {path} is neither a file nor a folder")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(file)))
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state
