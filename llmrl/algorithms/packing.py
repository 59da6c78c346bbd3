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

Shared prefixes: the rollouts of a GRPO group repeat one prompt, often most of their tokens (a
2-digit addition: an 18-token prompt, a 4-token answer). `share_prefixes` finds sequences with the
same context (the tokens before their first loss token) and `build_batch` lays such a group out as
the prefix once, then each member's remaining tokens with positions going on from the prefix. Position
ids cannot express that pattern, so the batch then carries an explicit ``[R, 1, T, T]`` boolean
attention mask (each member sees the prefix and itself; transformers passes a 4D mask to the kernel
unchanged), and ``context_positions`` says which column predicts each token: a member's first token
is predicted from the prefix's last one. Every token's logprob is then the one it has alone, and the
prefix's activations receive the sum of the members' gradients, which is what separate copies would
have added up to in the weights: the same loss and gradient from fewer tokens. Whether sharing
pays, and how long rows should be, depends on the model and the lengths: `plan_rows` decides.
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
class SharedPrefix:
    """Sequences that begin with the same `length` tokens, laid out as that prefix once followed by
    each member's remaining tokens (GRPO samples of one prompt: the prompt is encoded once).

    The prefix must hold no loss token of any member; a member's first remaining token is predicted
    from the prefix's last position.
    """

    members: tuple[int, ...]
    length: int


Unit = int | SharedPrefix
"""What a row of `build_batch` holds: a sequence index (laid out whole) or a `SharedPrefix`."""


def unit_tokens(unit: Unit, lengths: Sequence[int]) -> int:
    """Tokens `unit` takes in a row, given each sequence's length."""
    if isinstance(unit, SharedPrefix):
        return unit.length + sum(lengths[i] - unit.length for i in unit.members)
    return lengths[unit]


def share_prefixes(
    sequences: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[bool]],
    indices: Sequence[int],
    max_tokens: int,
) -> list[Unit]:
    """The sequences at `indices` as units for `build_batch`, sharing every context seen more than once.

    A sequence's context is its tokens before its first loss token (a rollout's prompt). Sequences
    with the same context become `SharedPrefix` units of at most `max_tokens` tokens each (members in
    the order of `indices`, a new unit whenever the next member would not fit); the rest stay plain.
    Units come in the order of their first member.
    """
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i in indices:
        mask = loss_masks[i]
        start = mask.index(True) if True in mask else 0  # no loss token: nothing to share (context ())
        by_context.setdefault(tuple(sequences[i][:start]), []).append(i)
    units: list[Unit] = []
    lengths = {i: len(sequences[i]) for i in indices}
    for context, members in by_context.items():
        if len(members) == 1 or not context:
            units.extend(members)
            continue
        chunk: list[int] = []
        tokens = len(context)
        for i in members:
            if chunk and tokens + lengths[i] - len(context) > max_tokens:
                units.append(_shared_or_plain(chunk, len(context)))
                chunk, tokens = [], len(context)
            chunk.append(i)
            tokens += lengths[i] - len(context)
        units.append(_shared_or_plain(chunk, len(context)))
    first_member = {i: position for position, i in enumerate(indices)}
    return sorted(units, key=lambda unit: first_member[_members(unit)[0]])


def plan_rows(
    sequences: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[bool]],
    indices: Sequence[int],
    max_row_tokens: int,
    *,
    token_cost: float,
    pair_cost: float,
    share: bool = True,
    by_sequence: bool = False,
) -> tuple[list[Unit], int]:
    """Units and a row length for packing the sequences at `indices` at the least estimated cost.

    A row of T tokens is taken to cost ``token_cost * T + pair_cost * T**2``: the layers' work grows
    with the tokens, attention's with the square of the row (the sdpa and eager kernels apply a
    packed row's mask densely, so a 512-token row of 80-token sequences does 6x the attention work
    of those sequences alone). Shared prefixes save tokens but need rows that hold a prompt and
    several completions. The candidates are the row lengths from the longest sequence, doubling, up
    to `max_row_tokens`, each with shared prefixes (when `share`) and without; rows are packed with
    `pack` and the cheapest candidate wins (the first on a tie). Returns ``(units, row length)``.

    `by_sequence`: attention runs over each sequence alone (varlen attention), so its cost is the sum
    of the sequences' squares whatever the rows; what the rows change is padding, every row padded to
    the longest: a candidate costs ``token_cost * rows * longest row`` plus that fixed attention term,
    so rows as full as `pack` can make them win.
    """
    lengths = [len(s) for s in sequences]
    longest = max(lengths[i] for i in indices)
    limits = [longest]
    while limits[-1] * 2 < max_row_tokens:
        limits.append(limits[-1] * 2)
    if max_row_tokens > longest:
        limits.append(max_row_tokens)
    best: tuple[float, list[Unit], int] | None = None
    for limit in limits:
        for shared in (False, True) if share else (False,):
            units = share_prefixes(sequences, loss_masks, indices, limit) if shared else list(indices)
            unit_lengths = [unit_tokens(unit, lengths) for unit in units]
            rows = pack(unit_lengths, max(limit, *unit_lengths))
            row_tokens = [sum(unit_lengths[j] for j in row) for row in rows]
            if by_sequence:
                cost = token_cost * len(rows) * max(row_tokens) + pair_cost * sum(t * t for t in unit_lengths)
            else:
                cost = sum(token_cost * t + pair_cost * t * t for t in row_tokens)
            if best is None or cost < best[0]:
                best = (cost, units, limit)
    assert best is not None
    return best[1], best[2]


def _shared_or_plain(members: list[int], length: int) -> Unit:
    return SharedPrefix(tuple(members), length) if len(members) > 1 else members[0]


@dataclass(frozen=True)
class PackedBatch:
    """Model inputs for rows of concatenated sequences (all tensors ``[R, T]`` unless noted).

    Attributes:
        input_ids: token ids; padding is `pad_token_id`.
        position_ids: each sequence's own positions (restarting at 0; a shared prefix's members go on
            from its end); padding continues its row's last sequence.
        sequence_ids: index of each token's sequence in the caller's list (a shared prefix: its first
            member's); -1 on padding.
        loss_mask: True on tokens whose logprob the loss uses (never the first token of a sequence).
        context_positions: the column of the same row whose hidden state predicts each token (the
            previous one, or a shared prefix's last token for its members' first tokens).
        spans: sequence index -> ``(row, start, stop)`` pieces of the row that hold its tokens, in order.
        attention_mask: ``[R, 1, T, T]`` bool, True where a query may attend to a key, when a row holds
            a shared prefix; otherwise None, and the model reads the sequences from the position ids.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor
    loss_mask: torch.Tensor
    context_positions: torch.Tensor
    spans: dict[int, tuple[tuple[int, int, int], ...]]
    attention_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens; a shared prefix counts once."""
        return int((self.sequence_ids >= 0).sum())

    def to(self, device: torch.device | str) -> PackedBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            sequence_ids=self.sequence_ids.to(device),
            loss_mask=self.loss_mask.to(device),
            context_positions=self.context_positions.to(device),
            attention_mask=None if self.attention_mask is None else self.attention_mask.to(device),
        )


def build_batch(
    sequences: Sequence[Sequence[int]],
    rows: Sequence[Sequence[Unit]],
    loss_masks: Sequence[Sequence[bool]] | None = None,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Lay out the units of each row (e.g. a bin from `pack`) end to end, one row each.

    Args:
        sequences: token ids of every sequence (prompt and completion).
        rows: per row, its units: sequence indices (``[[i] for i in ...]`` gives a plain right-padded
            batch) or `SharedPrefix` groups (see `share_prefixes`).
        loss_masks: per sequence and token, True where the loss uses the token's logprob (usually
            the generated tokens). The first token of a sequence has no context and must be False.
            None means every token but the first.
        pad_token_id: id written into padding.
    """
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("rows must be a non-empty list of non-empty lists of units")
    used = [i for row in rows for unit in row for i in _members(unit)]
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
    for unit in (unit for row in rows for unit in row if isinstance(unit, SharedPrefix)):
        _check_shared_prefix(unit, sequences, loss_masks)

    lengths = [len(s) for s in sequences]
    width = max(sum(unit_tokens(unit, lengths) for unit in row) for row in rows)
    # Built as Python lists, row by row, and turned into tensors once: per-piece tensor writes cost
    # more than the forward pass of a small model.
    spans: dict[int, tuple[tuple[int, int, int], ...]] = {}
    layouts: list[_RowLayout] = []
    for r, row in enumerate(rows):
        layout = _RowLayout(first_block=layouts[-1].next_block if layouts else 0)
        for unit in row:
            if isinstance(unit, SharedPrefix):
                prefix_block = layout.next_block
                first = unit.members[0]
                prefix = layout.place(sequences[first], loss_masks[first], first, 0, unit.length)
                for i in unit.members:
                    own = layout.place(
                        sequences[i],
                        loss_masks[i],
                        i,
                        unit.length,
                        lengths[i],
                        predicted_from=prefix[1] - 1,
                        prefix_block=prefix_block,
                    )
                    spans[i] = ((r, *prefix), (r, *own))
            else:
                spans[unit] = ((r, *layout.place(sequences[unit], loss_masks[unit], unit, 0, lengths[unit])),)
        layout.pad(width, pad_token_id)
        layouts.append(layout)

    def stacked(field: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(layout, field) for layout in layouts], dtype=dtype)

    attention_mask = None
    if any(isinstance(unit, SharedPrefix) for row in rows for unit in row):
        block, sees = stacked("block", torch.long), stacked("sees", torch.long)  # (R, T)
        keys = block[:, None, :]
        visible = (keys == block[:, :, None]) | (keys == sees[:, :, None])  # (R, T queries, T keys)
        attention_mask = (visible & torch.ones(width, width, dtype=torch.bool).tril())[:, None]
    return PackedBatch(
        input_ids=stacked("ids", torch.long),
        position_ids=stacked("positions", torch.long),
        sequence_ids=stacked("owners", torch.long),
        loss_mask=stacked("loss", torch.bool),
        context_positions=stacked("context", torch.long).clamp(min=0),
        spans=spans,
        attention_mask=attention_mask,
    )


class _RowLayout:
    """One row of `build_batch` as Python lists. Every token also gets a block (the prefix or
    sequence piece it belongs to; blocks are numbered across rows) and the block of the shared prefix
    it may see (-1 for none), from which the attention mask is built."""

    def __init__(self, first_block: int):
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.owners: list[int] = []
        self.loss: list[bool] = []
        self.context: list[int] = []
        self.block: list[int] = []
        self.sees: list[int] = []
        self.next_block = first_block

    def place(
        self,
        sequence: Sequence[int],
        mask: Sequence[bool],
        owner: int,
        first: int,
        last: int,
        *,
        predicted_from: int | None = None,
        prefix_block: int = -1,
    ) -> tuple[int, int]:
        """Append tokens ``first..last-1`` of `sequence` as a new block; returns their columns.

        The block's first token is predicted from column `predicted_from` (default: the one before).
        """
        start, count = len(self.ids), last - first
        self.ids.extend(sequence[first:last])
        self.positions.extend(range(first, last))
        self.owners.extend([owner] * count)
        self.loss.extend(mask[first:last])
        self.context.append(start - 1 if predicted_from is None else predicted_from)
        self.context.extend(range(start, start + count - 1))
        self.block.extend([self.next_block] * count)
        self.sees.extend([prefix_block] * count)
        self.next_block += 1
        return start, start + count

    def pad(self, width: int, pad_token_id: int) -> None:
        """Fill the row to `width`; pad positions continue the last sequence, each pad token its own block."""
        count = width - len(self.ids)
        self.ids.extend([pad_token_id] * count)
        self.positions.extend(range(self.positions[-1] + 1, self.positions[-1] + 1 + count))
        self.owners.extend([-1] * count)
        self.loss.extend([False] * count)
        self.context.extend(range(len(self.context) - 1, width - 1))
        self.block.extend(range(self.next_block, self.next_block + count))
        self.sees.extend([-1] * count)
        self.next_block += count


def _members(unit: Unit) -> tuple[int, ...]:
    return unit.members if isinstance(unit, SharedPrefix) else (unit,)


def _check_shared_prefix(
    unit: SharedPrefix, sequences: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[bool]]
) -> None:
    first = unit.members[0]
    prefix = list(sequences[first][: unit.length])
    for i in unit.members:
        if not 1 <= unit.length < len(sequences[i]):
            raise ValueError(
                f"SharedPrefix length {unit.length} must be in 1..{len(sequences[i]) - 1} (sequences[{i}])"
            )
        if list(sequences[i][: unit.length]) != prefix:
            raise ValueError(
                f"sequences[{i}] does not begin with the {unit.length} tokens of sequences[{first}]"
            )
        if any(loss_masks[i][: unit.length]):
            raise ValueError(f"loss_masks[{i}] has loss tokens in the shared prefix of {unit.length} tokens")


def pack_values(
    values: Sequence[Sequence[float]],
    batch: PackedBatch,
    fill: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Lay out per-token values (e.g. inference logprobs) of each sequence like `batch` -> ``[R, T, ...]``.

    ``values[i]`` has one entry per token of sequence ``i`` (a number, or a tensor of one shape for all,
    which trails ``[R, T]``); padding gets `fill`. A shared prefix gets its first member's values (all
    members' are the same for anything computed from the tokens).
    """
    first = next(iter(batch.spans), None)
    trailing = () if first is None else tuple(torch.as_tensor(values[first]).shape[1:])
    out = torch.full((*batch.input_ids.shape, *trailing), fill, dtype=dtype)
    for i, pieces in batch.spans.items():
        length = sum(stop - start for _, start, stop in pieces)
        if len(values[i]) != length:
            raise ValueError(f"values[{i}] has {len(values[i])} entries for a sequence of {length} tokens")
        offset = 0
        for row, start, stop in pieces:
            if batch.sequence_ids[row, start] == i:  # a shared prefix is written by its first member only
                out[row, start:stop] = torch.as_tensor(values[i][offset : offset + stop - start], dtype=dtype)
            offset += stop - start
    return out.to(batch.input_ids.device)


def unpack(values: torch.Tensor, batch: PackedBatch) -> dict[int, torch.Tensor]:
    """Split per-token outputs ``[R, T, ...]`` of a packed batch back into one tensor per sequence.

    Returns ``{sequence index: values of its tokens}`` (a shared prefix's values in each of its
    members); padding is dropped.
    """
    if values.shape[:2] != batch.input_ids.shape:
        raise ValueError(
            f"values has shape {tuple(values.shape)}, the batch is {tuple(batch.input_ids.shape)}"
        )
    out: dict[int, torch.Tensor] = {}
    for i, pieces in batch.spans.items():
        parts = [values[row, start:stop] for row, start, stop in pieces]
        out[i] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out


def has_local_attention(config: object) -> bool:
    """Whether a model config has sliding-window (local) attention layers."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return any(kind != "full_attention" for kind in layer_types)
    return (
        bool(getattr(config, "sliding_window", None))
        and getattr(config, "use_sliding_window", True) is not False
    )
