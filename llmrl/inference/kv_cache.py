"""The KV cache of the Llama/Qwen2 decoder: row and shared caches, their growth, rows leaving.

Two caches, because a GRPO group's ``n`` samples share their prompt:

``shared_k/v: (layers, groups, kv_heads, capacity, D)`` one copy of a group's prompt;
``row_k/v: (layers, rows, kv_heads, capacity, D)`` each row's own tokens.

Which groups share their prompt is the decoder's choice (``llama_decoder.py``); this module keeps
the tensors and the bookkeeping of groups and rows. Rows leave by moving the last rows into their
slots (cost proportional to the rows removed); a group's shared entry leaves with its last row. Row
capacity doubles (up to ``max_rows``), and so does length capacity, in steps of 16, up to the most
any running row can reach. The cache is zero-filled, so masked positions never hold NaN (0 x NaN
is NaN): they hold zeros or what rows that left wrote there, finite keys and values. On CPU the
cache's memory outlives its batch (``KEEP_WHILE_IDLE``): fresh memory costs page faults, a few ms
per growth of a 64-row batch.

Also here, as the cache's bookkeeping needs them: `list_tensor` (index tensors from Python lists,
also used by the engine) and `max_positions` (the context a model's cache may hold).
"""

from __future__ import annotations

import array
from typing import Literal, NamedTuple

import torch

_ARRAY_CODES = {torch.int64: "q", torch.float32: "f"}


def list_tensor(values: list, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` for a flat list of ints (int64) or
    floats (float32), faster: `torch.tensor` converts element by element, a typed `array` in one
    pass."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype).to(device)


def max_positions(config) -> int:
    """The most positions (prompt and completion) a model's config allows."""
    return int(
        getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
    )


class RowIndex(NamedTuple):
    """The cache's bookkeeping as the forward pass reads it, one int64 tensor each."""

    group: torch.Tensor  # (B,) each row's group
    slot: torch.Tensor  # (B,) each row's index among its group's live rows
    cached: torch.Tensor  # (B,) tokens in each row's own cache
    shared: torch.Tensor  # (B,) prompt positions of each row's group in the shared cache (0: inline)
    grid: torch.Tensor  # (groups, widest group): the row at each cell of the query grid (0 where none)


class KVCache:
    """Keys and values of a batch's prompt groups and rows (module docstring).

    Python lists are the truth about groups and rows; `index`, rebuilt by `sync_rows`, mirrors
    them as tensors.
    """

    CAPACITY_STEP = 16
    """Cache lengths are multiples of this. A row cache's length at least doubles when it grows, up
    to what its rows can reach (prompt plus ``max_new_tokens``), so growth copies are rare."""
    KEEP_WHILE_IDLE = 1 << 30
    """On CPU, a KV cache of at most this many bytes stays allocated when its batch ends (`reset`),
    so the next batch reuses it instead of growing into fresh memory, whose first touch of each
    4 KiB page faults, a noticeable share of a small model's batch. On CUDA, torch's caching
    allocator already reuses the memory, and training may need it while the engine idles."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        max_rows: int | None = None,
    ):
        """`max_rows` caps how far row capacity doubles (rows beyond it are still served)."""
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_positions = max_positions
        self.device, self.dtype = device, dtype
        self.max_rows = max_rows
        self.shared_k = self.shared_v = None  # (layers, groups_cap, kv_heads, shared_cap, D)
        self.row_k = self.row_v = None  # (layers, rows_cap, kv_heads, row_cap, D)
        self.reset()

    def reset(self) -> None:
        """Drop every group and row; the tensors stay allocated on CPU up to `KEEP_WHILE_IDLE` bytes."""
        self.shared_lengths: list[int] = []  # per group: prompt tokens in the shared cache (0: inline)
        self.group_rows: list[int] = []  # per group: live rows
        self.row_group: list[int] = []  # per row: its group
        self.cached: list[int] = []  # per row: tokens in its own cache (inline prompt + generated)
        self.reach: list[int] = []  # per row: the most positions its own cache will need
        if self.device.type != "cpu" or self.cache_bytes > self.KEEP_WHILE_IDLE:
            self.shared_k = self.shared_v = None
            self.row_k = self.row_v = None
        self.sync_rows()

    @property
    def num_rows(self) -> int:
        return len(self.row_group)

    @property
    def num_groups(self) -> int:
        return len(self.shared_lengths)

    @property
    def cache_bytes(self) -> int:
        tensors = (self.shared_k, self.shared_v, self.row_k, self.row_v)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def add_groups(
        self, prompt_lengths: list[int], copies: list[int], shared: list[bool], reach: list[int]
    ) -> None:
        """Record new groups (one per prompt, `copies[i]` rows each, the prompt in the shared cache
        where `shared[i]`, else in each row's own) and each new row's `reach`."""
        for group, (length, count, share) in enumerate(
            zip(prompt_lengths, copies, shared, strict=True), start=self.num_groups
        ):
            self.shared_lengths.append(length if share else 0)
            self.group_rows.append(count)
            self.row_group.extend([group] * count)
            self.cached.extend([0 if share else length] * count)
        self.reach.extend(reach)
        self.sync_rows()

    def advance(self) -> None:
        """Every row cached one more token (a decode step wrote it)."""
        self.cached = [n + 1 for n in self.cached]
        self.index = self.index._replace(cached=self.index.cached + 1)

    def sync_rows(self) -> None:
        """Rebuild the per-row index tensors after rows joined or left."""
        slots, seen = [], [0] * self.num_groups
        for group in self.row_group:  # each row's index among its group's live rows
            slots.append(seen[group])
            seen[group] += 1
        # The query grid: (groups, widest group); cells of no row read row 0 and are never read back.
        height, width = max(self.num_groups, 1), max([*seen, 1])
        grid = [0] * (height * width)
        for row, (group, slot) in enumerate(zip(self.row_group, slots, strict=True)):
            grid[group * width + slot] = row
        shared = [self.shared_lengths[g] for g in self.row_group]
        # One tensor holds them all: building a tensor costs more than a few views of one.
        rows = self.num_rows
        values = list_tensor(
            [*self.row_group, *slots, *self.cached, *shared, *grid], torch.int64, self.device
        )
        self.index = RowIndex(*values[: 4 * rows].view(4, rows), values[4 * rows :].view(height, width))

    def reserve(
        self, which: Literal["shared", "row"], entries: int, length: int, reach: int | None = None
    ) -> None:
        """Grow the shared or row cache to hold `entries` x `length` positions (copying what is used).

        A length that grows at least doubles, up to `reach` (the most any row will need)."""
        k_cache, v_cache = getattr(self, f"{which}_k"), getattr(self, f"{which}_v")
        cap_entries, cap_length = (0, 0) if k_cache is None else (k_cache.shape[1], k_cache.shape[3])
        if entries > cap_entries or length > cap_length:
            new_entries = cap_entries
            if entries > cap_entries:
                new_entries = max(entries, min(2 * cap_entries, self.max_rows or 2 * cap_entries))
            new_length = cap_length
            if length > cap_length:
                new_length = max(length, min(2 * cap_length, reach or 2 * cap_length))
            new_length = min(-(-new_length // self.CAPACITY_STEP) * self.CAPACITY_STEP, self.max_positions)
            shape = (self.num_layers, new_entries, self.num_kv_heads, new_length, self.head_dim)
            new_k, new_v = (self._grown(old, shape) for old in (k_cache, v_cache))
            setattr(self, f"{which}_k", new_k)
            setattr(self, f"{which}_v", new_v)

    def _grown(self, cache: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        """A cache of `shape` holding `cache` (None: empty) at its start, zeros elsewhere.

        Zeros, not stale memory: masked positions still meet a 0 weight in attention, and 0 * NaN
        would poison the row. Only the new part is zeroed (the old part is copied over it).
        """
        if cache is None:
            return torch.zeros(shape, device=self.device, dtype=self.dtype)
        entries, length = cache.shape[1], cache.shape[3]
        grown = torch.empty(shape, device=self.device, dtype=self.dtype)
        grown[:, :entries, :, :length] = cache
        grown[:, :entries, :, length:] = 0
        grown[:, entries:] = 0
        return grown

    def remove_rows(self, rows: list[int]) -> list[int]:
        """Drop `rows` (and groups left without rows); return the old index of each remaining row."""
        order = swap_remove(self.num_rows, rows, (self.row_k, self.row_v), max(self.cached, default=0))
        for row in rows:
            self.group_rows[self.row_group[row]] -= 1
        self.row_group = [self.row_group[r] for r in order]
        self.cached = [self.cached[r] for r in order]
        self.reach = [self.reach[r] for r in order]
        dead = [g for g, live in enumerate(self.group_rows) if live == 0]
        if dead:
            group_order = swap_remove(
                self.num_groups, dead, (self.shared_k, self.shared_v), max(self.shared_lengths)
            )
            new_index = {old: new for new, old in enumerate(group_order)}
            self.shared_lengths = [self.shared_lengths[g] for g in group_order]
            self.group_rows = [self.group_rows[g] for g in group_order]
            self.row_group = [new_index[g] for g in self.row_group]
        self.sync_rows()
        return order


def swap_remove(
    count: int, removed: list[int], caches: tuple[torch.Tensor | None, ...] = (), used: int = 0
) -> list[int]:
    """Remove entries from dim 1 of `caches` by moving the last live entries into the holes (with no
    caches: only the new order, for bookkeeping that follows the same rule).

    Returns the old index of each remaining entry in its new position. Copies only the moved
    entries' first `used` positions, so removal costs what it moves, not the batch size.
    """
    gone = set(removed)
    remaining = count - len(gone)
    holes = sorted(i for i in gone if i < remaining)
    movers = [i for i in range(remaining, count) if i not in gone]
    assert len(holes) == len(movers)
    order = list(range(remaining))
    if used and caches[0] is not None:  # nothing cached yet: nothing to move
        # One slice copy per entry: for the few entries that leave at once, cheaper than one indexed copy.
        for cache in caches:
            for hole, mover in zip(holes, movers, strict=True):
                cache[:, hole, :, :used] = cache[:, mover, :, :used]
    for hole, mover in zip(holes, movers, strict=True):
        order[hole] = mover
    return order
