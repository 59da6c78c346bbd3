"""Sequence packing: many variable-length sequences in few rows, with no padding between them.

GRPO completions vary widely in length; padding every sequence to the longest wastes most of the
compute. `pack` assigns sequences to bins of at most ``max_tokens`` tokens by first-fit-decreasing
(Johnson 1973: at most 11/9 OPT + 6/9 bins), and `build_batch` lays each bin out as one row of
concatenated sequences.

How the model keeps sequences apart: no hand-written attention. We pass ``position_ids`` that restart
at 0 at the start of every sequence and *no* ``attention_mask``. Transformers (5.x,
``masking_utils.find_packed_sequence_indices``) then detects packed sequences wherever the position
ids do not increase by exactly 1, and ``create_causal_mask`` turns that into a block-diagonal causal
mask for the SDPA and eager kernels; the flash-attention path derives ``cu_seqlens`` from the same
position ids (``modeling_flash_attention_utils.prepare_fa_kwargs_from_position_ids``). Rotary
embeddings read the restarted position ids, so each token sees exactly what it would see alone.

A row shorter than the longest row is right-padded. Pad positions continue counting from the row's
last sequence: causal attention means no real token ever attends to a later pad token, and rows that
hold a single sequence then look unpacked to transformers (it can keep its plain causal fast path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch


def pack(lengths: Sequence[int], max_tokens: int, max_sequences: int | None = None) -> list[list[int]]:
    """Group sequence indices into bins of at most `max_tokens` tokens (first-fit-decreasing).

    Args:
        lengths: tokens of each sequence (prompt + completion).
        max_tokens: capacity of a bin.
        max_sequences: optional cap on sequences per bin.

    Returns the bins, each a sorted list of indices into `lengths`; every index appears exactly once.
    Example: ``pack([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]`` (5 opens bin 0, 4 opens bin 1, 3 joins
    bin 0, 2 joins bin 1).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_sequences is not None and max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1 (or None), got {max_sequences}")
    for index, length in enumerate(lengths):
        if not 1 <= length <= max_tokens:
            raise ValueError(f"lengths[{index}] = {length} must be in 1..max_tokens={max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []  # free tokens of each bin
    seq_limit = max_sequences if max_sequences is not None else len(lengths)
    # Longest first; ties keep their input order so the result is deterministic.
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        target = next((b for b in range(len(bins)) if room[b] >= length and len(bins[b]) < seq_limit), None)
        if target is None:
            bins.append([])
            room.append(max_tokens)
            target = len(bins) - 1
        bins[target].append(index)
        room[target] -= length
    return [sorted(b) for b in bins]


def packing_efficiency(lengths: Sequence[int], bins: Sequence[Sequence[int]], max_tokens: int) -> float:
    """Real tokens / bin tokens (``len(bins) * max_tokens``): 1.0 means no wasted slot."""
    if not bins:
        return 0.0
    return sum(lengths[i] for b in bins for i in b) / (len(bins) * max_tokens)


@dataclass(frozen=True)
class PackedBatch:
    """Model inputs for rows of concatenated sequences (all tensors ``[R, T]``).

    Attributes:
        input_ids: token ids; padding is `pad_token_id`.
        position_ids: restart at 0 at every sequence; padding continues its row's last sequence.
        sequence_ids: index of each token's sequence in the caller's list; -1 on padding.
        loss_mask: True on tokens whose logprob the loss uses (never the first token of a sequence).
        segments: per row, ``(sequence index, length)`` of each sequence, in row order.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor
    loss_mask: torch.Tensor
    segments: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return sum(length for row in self.segments for _, length in row)

    def to(self, device: torch.device | str) -> PackedBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            sequence_ids=self.sequence_ids.to(device),
            loss_mask=self.loss_mask.to(device),
        )


def build_batch(
    sequences: Sequence[Sequence[int]],
    rows: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[bool]] | None = None,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Lay out ``sequences[i]`` for the indices of each row (e.g. a bin from `pack`) as one row.

    Args:
        sequences: token ids of every sequence (prompt and completion).
        rows: sequence indices per row; ``[[i] for i in ...]`` gives a plain right-padded batch.
        loss_masks: per sequence and token, True where the loss uses the token's logprob (usually
            the generated tokens). The first token of a sequence has no context and must be False.
            None means every token but the first.
        pad_token_id: id written into padding.
    """
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("rows must be a non-empty list of non-empty lists of sequence indices")
    used = [i for row in rows for i in row]
    if len(set(used)) != len(used) or not all(0 <= i < len(sequences) for i in used):
        raise ValueError(f"rows must hold distinct sequence indices in 0..{len(sequences) - 1}")
    if loss_masks is None:
        loss_masks = [[False] + [True] * (len(s) - 1) for s in sequences]
    if len(loss_masks) != len(sequences):
        raise ValueError(f"loss_masks has {len(loss_masks)} entries for {len(sequences)} sequences")
    for i in used:
        if len(sequences[i]) == 0:
            raise ValueError(f"sequences[{i}] is empty")
        if len(loss_masks[i]) != len(sequences[i]):
            raise ValueError(
                f"loss_masks[{i}] has {len(loss_masks[i])} entries for {len(sequences[i])} tokens"
            )
        if loss_masks[i][0]:
            raise ValueError(
                f"loss_masks[{i}][0] must be False: the first token has no context to predict it from"
            )

    width = max(sum(len(sequences[i]) for i in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    sequence_ids = torch.full((len(rows), width), -1, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            span = slice(offset, offset + len(sequences[i]))
            input_ids[r, span] = torch.as_tensor(sequences[i], dtype=torch.long)
            position_ids[r, span] = torch.arange(len(sequences[i]))
            sequence_ids[r, span] = i
            loss_mask[r, span] = torch.as_tensor(loss_masks[i], dtype=torch.bool)
            offset += len(sequences[i])
        last_start = offset - len(sequences[row[-1]])
        position_ids[r, offset:] = torch.arange(offset - last_start, width - last_start)
    segments = tuple(tuple((i, len(sequences[i])) for i in row) for row in rows)
    return PackedBatch(input_ids, position_ids, sequence_ids, loss_mask, segments)


def pack_values(
    values: Sequence[Sequence[float]],
    batch: PackedBatch,
    fill: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Lay out per-token values (e.g. inference logprobs) of each sequence like `batch` -> ``[R, T]``.

    ``values[i]`` has one entry per token of sequence ``i``; padding gets `fill`.
    """
    out = torch.full(batch.input_ids.shape, fill, dtype=dtype)
    for r, row in enumerate(batch.segments):
        offset = 0
        for i, length in row:
            if len(values[i]) != length:
                raise ValueError(
                    f"values[{i}] has {len(values[i])} entries for a sequence of {length} tokens"
                )
            out[r, offset : offset + length] = torch.as_tensor(values[i], dtype=dtype)
            offset += length
    return out.to(batch.input_ids.device)


def unpack(values: torch.Tensor, batch: PackedBatch) -> dict[int, torch.Tensor]:
    """Split per-token outputs ``[R, T, ...]`` of a packed batch back into one tensor per sequence.

    Returns ``{sequence index: values of its tokens}``; padding is dropped.
    """
    if values.shape[:2] != batch.input_ids.shape:
        raise ValueError(
            f"values has shape {tuple(values.shape)}, the batch is {tuple(batch.input_ids.shape)}"
        )
    out: dict[int, torch.Tensor] = {}
    for r, row in enumerate(batch.segments):
        offset = 0
        for i, length in row:
            out[i] = values[r, offset : offset + length]
            offset += length
    return out
