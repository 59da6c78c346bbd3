"""A paged KV cache: fixed-size blocks in one pool per keys and values, rows addressed by block tables.

``pool_k/v: (layers, blocks, kv_heads, BLOCK, D)``. A row's positions ``0, 1, ...`` sit in the
blocks its table lists, ``BLOCK`` positions each. The ``n`` rows of a prompt group share the blocks
its prompt fills whole (each block counted once per row that lists it, freed when no row does);
the prompt's last, partly filled block is copied into a block of each row's own, where its
generated tokens go on. Rows leave without moving any keys: their blocks return to the free list.

Block 0 is never handed out: the padded rows of a static decode step (``static_decode.py``) read
and write it, so whatever they compute lands where no row looks. The pool is zero-filled, and
every position a row has not written is masked by its length, so masked positions hold finite
values (0 x NaN would be NaN).

The pool is allocated once, for the tokens the engine admits (``reserve_tokens``) and a block of
slack per row; it doubles when a batch outgrows it, which bumps `version` so that captured CUDA
graphs, which hold its address, are captured again.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from llmrl.inference.kv_cache import list_tensor, swap_remove

SCRATCH_BLOCK = 0
"""The block padded rows point to (module docstring)."""


class PagedKVCache:
    """Keys and values of a batch's rows in blocks (module docstring). Python lists are the truth about
    rows and blocks; `lengths` and `table` mirror them as tensors."""

    BLOCK = 16
    """Positions per block: a row wastes fewer than this many positions of cache, and the gather
    that reads a row's blocks moves this many positions at once."""
    KEEP_WHILE_IDLE = 1 << 30
    """On CPU, a pool of at most this many bytes stays allocated when its batch ends (as
    `KVCache.KEEP_WHILE_IDLE`). On CUDA the pool stays only when `kept_on_cuda` (captured graphs hold
    its address; the memory plan counts the engine's KV cache beside the update) and it has not grown
    past its first size, else it goes with its batch, so that training has the memory."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        reserve_tokens: int,
        max_rows: int,
        kept_on_cuda: bool = False,
    ):
        self.kept_on_cuda = kept_on_cuda
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.device, self.dtype = device, dtype
        # Per row, two blocks beyond its tokens: its copy of a shared prompt's last block, its last block's
        # free positions.
        self.initial_blocks = 1 + math.ceil(reserve_tokens / self.BLOCK) + 2 * max_rows
        self.pool_k = self.pool_v = None
        self.version = 0
        """Bumped whenever the pool is allocated anew (its address changes)."""
        self.reset()

    def reset(self) -> None:
        """Drop every row; the pool stays allocated as `KEEP_WHILE_IDLE` says."""
        self.row_blocks: list[list[int]] = []  # per row: its blocks, position p in row_blocks[p // BLOCK]
        self.row_lengths: list[int] = []  # per row: positions cached
        if self.device.type == "cuda":  # a pool that grew past the plan's size goes back to it
            kept = (
                self.kept_on_cuda and self.pool_k is not None and self.pool_k.shape[1] == self.initial_blocks
            )
        else:
            kept = self.cache_bytes <= self.KEEP_WHILE_IDLE
        if not kept:
            self.pool_k = self.pool_v = None
        blocks = self.initial_blocks if self.pool_k is None else self.pool_k.shape[1]
        self.references = [0] * blocks  # per block: rows listing it
        self.free = list(range(blocks - 1, SCRATCH_BLOCK, -1))  # popped from the end: low blocks first
        self._synced()

    @property
    def num_rows(self) -> int:
        return len(self.row_blocks)

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pool_k, self.pool_v) if t is not None)

    @property
    def num_blocks(self) -> int:
        return len(self.references)

    def _allocate(self, count: int) -> list[int]:
        """`count` free blocks, each referenced once; the pool doubles first when too few are free."""
        while len(self.free) < count:
            self._double()
        if self.pool_k is None:
            shape = (self.num_layers, self.num_blocks, self.num_kv_heads, self.BLOCK, self.head_dim)
            self.pool_k, self.pool_v = (
                torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(2)
            )
            self.version += 1
        taken = [self.free.pop() for _ in range(count)]
        for block in taken:
            self.references[block] = 1
        return taken

    def _double(self) -> None:
        old = self.num_blocks
        self.references += [0] * old
        self.free = list(range(2 * old - 1, old - 1, -1)) + self.free
        if self.pool_k is not None:
            grown = []
            for pool in (self.pool_k, self.pool_v):
                new = pool.new_zeros((pool.shape[0], 2 * old, *pool.shape[2:]))
                new[:, :old] = pool
                grown.append(new)
            self.pool_k, self.pool_v = grown
            self.version += 1

    def add_rows(self, prompt_lengths: list[int], copies: list[int]) -> PrefillPlan:
        """New rows, `copies[i]` of them for prompt i (in order): blocks for their prompts, and where
        the prefill writes each prompt position (`PrefillPlan`)."""
        block = self.BLOCK
        sources: list[int] = []  # per written position: its prompt
        positions: list[int] = []  # and its position in the prompt
        destinations: list[int] = []  # its block
        for prompt, (length, count) in enumerate(zip(prompt_lengths, copies, strict=True)):
            whole, tail = divmod(length, block)
            shared = self._allocate(whole)
            for index, target in enumerate(shared):
                self.references[target] = count
                sources.extend([prompt] * block)
                positions.extend(range(index * block, (index + 1) * block))
                destinations.extend([target] * block)
            for _ in range(count):
                own = self._allocate(1) if tail else []
                for target in own:
                    sources.extend([prompt] * tail)
                    positions.extend(range(whole * block, length))
                    destinations.extend([target] * tail)
                self.row_blocks.append([*shared, *own])
                self.row_lengths.append(length)
        self._synced()
        offsets = [p % block for p in positions]
        values = list_tensor([*sources, *positions, *destinations, *offsets], torch.int64, self.device)
        return PrefillPlan(*values.view(4, len(sources)))

    def prepare_step(self) -> None:
        """A block for every row whose next position starts one; `table` updated."""
        grown = False
        for blocks, length in zip(self.row_blocks, self.row_lengths, strict=True):
            if length // self.BLOCK >= len(blocks):
                blocks.extend(self._allocate(1))
                grown = True
        if grown:
            self._sync_table()

    def advance(self) -> None:
        """Every row cached one more position (a decode step wrote it)."""
        self.row_lengths = [n + 1 for n in self.row_lengths]
        self.lengths += 1

    def remove_rows(self, rows: list[int]) -> list[int]:
        """Drop `rows`, their blocks freed where no other row lists them; the last rows take the
        holes, as in `KVCache` (a matmul's rounding may depend on a row's place). Returns the old
        index of each remaining row, in the new row order."""
        gone = set(rows)
        for row in gone:
            for block in self.row_blocks[row]:
                self.references[block] -= 1
                if not self.references[block]:
                    self.free.append(block)
        order = swap_remove(self.num_rows, rows)
        self.row_blocks = [self.row_blocks[row] for row in order]
        self.row_lengths = [self.row_lengths[row] for row in order]
        self._synced()
        return order

    def _synced(self) -> None:
        self.lengths = list_tensor(self.row_lengths, torch.int64, self.device)  # (B,)
        self._sync_table()

    def _sync_table(self) -> None:
        """`table` (B, width): each row's blocks, then the scratch block; the width is a power of two
        (at least the widest row), so that it changes seldom (a captured graph has a fixed width)."""
        width = 1 << max(0, (max(map(len, self.row_blocks), default=1) - 1).bit_length())
        cells = [b for blocks in self.row_blocks for b in (*blocks, *[SCRATCH_BLOCK] * (width - len(blocks)))]
        self.table = list_tensor(cells, torch.int64, self.device).view(self.num_rows, width)

    def gather(self, pool: torch.Tensor, table: torch.Tensor, span: int) -> torch.Tensor:
        """The first `span` positions of the rows whose blocks `table` lists, (B, kv_heads, span, D),
        from one layer's `pool` (blocks, kv_heads, BLOCK, D)."""
        pages = table[:, : -(-span // self.BLOCK)]
        rows, width = pages.shape
        gathered = pool[pages].transpose(1, 2).reshape(rows, self.num_kv_heads, width * self.BLOCK, -1)
        return gathered[:, :, :span]


class PrefillPlan(NamedTuple):
    """Where a prefill writes its prompts' keys and values: position ``positions[i]`` of prompt
    ``prompts[i]`` to offset ``offsets[i]`` of block ``blocks[i]`` (int64 tensors)."""

    prompts: torch.Tensor
    positions: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor

    def write(self, cache: PagedKVCache, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a prefill's (N, kv_heads, P, D) keys and values of layer `layer`."""
        cache.pool_k[layer][self.blocks, :, self.offsets] = keys[self.prompts, :, self.positions]
        cache.pool_v[layer][self.blocks, :, self.offsets] = values[self.prompts, :, self.positions]

    def write_packed(
        self, cache: PagedKVCache, layer: int, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor
    ) -> None:
        """Store a packed prefill's (T, kv_heads, D) keys and values of layer `layer`, prompt i's
        tokens from ``starts[i]`` on."""
        tokens = starts[self.prompts] + self.positions
        cache.pool_k[layer][self.blocks, :, self.offsets] = keys[tokens]
        cache.pool_v[layer][self.blocks, :, self.offsets] = values[tokens]
