"""Static decode: the decode step as one function over fixed buffers, replayed as CUDA graphs.

A decode step launched op by op from Python leaves a GPU idle between its hundreds of small
kernels; captured once as a ``torch.cuda.CUDAGraph`` and replayed, it is one launch. A graph
replays fixed shapes at fixed addresses, so:

* **Rows by bucket.** A step of ``B`` rows runs in the smallest bucket that holds them (`buckets`:
  1, 2, 4, 8, then multiples of 16), its buffers (tokens, lengths, block table, logits) allocated
  once per bucket. The rows beyond ``B`` are padding: token 0, length 0, every block the scratch
  block, so they attend and write only there (``paged_cache.py``).
* **A paged KV cache** (`PagedKVCache`) whose pool is allocated once (and kept between batches on
  CUDA), read through block tables: rows join and leave by their table rows, not by moving the
  cache. The attended window is the table's width in positions, masked by each row's length.
* **Weights in place.** Weight updates and LoRA merges copy into the tensors the graph reads
  (`LlamaFamilyDecoder.load_state_dict`, `MergedWeights`), so graphs stay valid across syncs.

A graph is captured per (bucket, table width) the first time that pair steps, and again after the
pool grows (its address changes). Prefill stays eager.

`StaticSteps` takes two switches. ``static_shapes`` pads to buckets and attends the whole table
width (what a graph needs); without it a step runs on its ``B`` rows and their longest length, the
eager path's arithmetic, so on a CPU the paged decoder's logits equal `LlamaFamilyDecoder`'s bit for
bit (with prompts inline: the paged cache keeps no cascade). With static shapes on a CPU the logits
differ in the last bits, because MKL's matmuls round differently with the number of rows.
``capture`` keeps one captured step per (bucket, width): a CUDA graph (`GraphedStep`) for CUDA
tensors, else its stand-in (`EagerStandIn`), which replays by running the step into the same output
buffer, so that the tests run the capturing, reuse and invalidation on a CPU.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch

from llmrl.inference.kv_cache import list_tensor
from llmrl.inference.llama_decoder import LlamaFamilyDecoder
from llmrl.inference.paged_cache import SCRATCH_BLOCK, PagedKVCache, PrefillPlan

DecodeFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""(tokens (B,), lengths (B,), block table (B, width), attended positions) -> logits (B, V)."""


def buckets(max_rows: int) -> list[int]:
    """The row counts a static step runs at: 1, 2, 4, 8, then multiples of 16, up to the first that
    holds `max_rows`."""
    sizes = [1, 2, 4, 8, *range(16, max_rows + 16, 16)]
    return sizes[: next(i for i, size in enumerate(sizes) if size >= max_rows) + 1]


def bucket_of(rows: int, sizes: list[int]) -> int:
    """The smallest bucket holding `rows`; past the largest, the next multiple of 16."""
    for size in sizes:
        if size >= rows:
            return size
    return -(-rows // 16) * 16


class _Buffers(NamedTuple):
    tokens: torch.Tensor  # (bucket,)
    lengths: torch.Tensor  # (bucket,)
    table: torch.Tensor  # (bucket, width)


class GraphedStep:
    """A step captured as a CUDA graph: `replay` runs it again over the same buffers and returns what
    it wrote (overwritten by the next replay).

    Captured after warm-up runs on a side stream (lazy initialisation, the allocator). The warm-ups
    write the rows' new keys and values where the replay writes them again: the same values, from
    the same inputs. Graphs that share `pool` share the memory of their intermediates: safe, as one
    replays at a time. The capture is the calling thread's alone (``thread_local``): the trainer may
    launch its own work from another thread meanwhile (`training.generation_lag`)."""

    def __init__(self, step: Callable[[], torch.Tensor], pool: tuple[int, int]):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.output = step()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class EagerStandIn:
    """`GraphedStep`'s stand-in off CUDA: `replay` runs the step eagerly, so that what surrounds the
    graphs (when one is captured, reused, dropped, where it writes) runs on a CPU."""

    def __init__(self, step: Callable[[], torch.Tensor]):
        self.step = step
        step()  # as a capture would: the warm-ups run the step

    def replay(self) -> torch.Tensor:
        return self.step()


class StaticSteps:
    """Runs a `DecodeFunction` at bucket shapes, captured as CUDA graphs (module docstring).

    Every captured step writes its logits into one shared buffer, the largest bucket's rows: each
    replay's rows are copied out at once, so one buffer serves all the graphs (a buffer per graph
    would hold a bucket x vocabulary of logits for each)."""

    def __init__(
        self, function: DecodeFunction, *, max_rows: int, block: int, static_shapes: bool, capture: bool
    ):
        if capture and not static_shapes:
            raise ValueError("capturing CUDA graphs needs static shapes")
        self.function = function
        self.sizes = buckets(max_rows)
        self.block = block
        self.static_shapes = static_shapes
        self.capture = capture
        self._buffers: dict[tuple[int, int], _Buffers] = {}
        self._graphs: dict[tuple[int, int], GraphedStep | EagerStandIn] = {}
        self._logits: torch.Tensor | None = None  # (rows, V): what every captured step writes into
        self._pool_version = -1
        self._graph_pool = None  # one memory pool shared by every captured graph
        self.captures = 0
        """Graphs captured so far (each a new (bucket, width) pair or a grown pool)."""

    def forget(self) -> None:
        """Drop every buffer and graph (their memory goes back; the next steps capture anew)."""
        self._buffers.clear()
        self._graphs.clear()
        self._logits = None
        self._graph_pool = None

    def run(
        self, tokens: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor, span: int, version: int
    ) -> torch.Tensor:
        """Logits (B, V) of one step of `tokens`' rows, `span` their longest cached length, `version`
        the KV pool's (a new one invalidates every graph)."""
        if not self.static_shapes:
            return self.function(tokens, lengths, table, span)
        if version != self._pool_version:
            self.forget()
            self._pool_version = version
        rows, width = table.shape
        key = (bucket_of(rows, self.sizes), width)
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = self._buffers[key] = _Buffers(
                tokens.new_zeros(key[0]), lengths.new_zeros(key[0]), table.new_full(key, SCRATCH_BLOCK)
            )
        buffers.tokens[:rows] = tokens
        buffers.tokens[rows:] = 0
        buffers.lengths[:rows] = lengths
        buffers.lengths[rows:] = 0
        buffers.table[:rows] = table
        buffers.table[rows:] = SCRATCH_BLOCK
        window = width * self.block
        if not self.capture:
            return self.function(*buffers, window)[:rows]
        captured = self._graphs.get(key)
        if captured is None:
            step = functools.partial(self._into_shared_logits, buffers, window)
            if tokens.is_cuda:
                if self._graph_pool is None:
                    self._graph_pool = torch.cuda.graph_pool_handle()
                captured = self._graphs[key] = GraphedStep(step, self._graph_pool)
            else:
                captured = self._graphs[key] = EagerStandIn(step)
            self.captures += 1
        return captured.replay()[:rows].clone()  # the next replay overwrites the buffer

    def _into_shared_logits(self, buffers: _Buffers, window: int) -> torch.Tensor:
        """The step over `buffers`, its logits written into the shared buffer (allocated by the first
        warm-up of the largest bucket so far, outside any capture)."""
        logits = self.function(*buffers, window)
        if self._logits is None or self._logits.shape[0] < logits.shape[0]:
            self._logits = logits.new_empty((max(logits.shape[0], self.sizes[-1]), logits.shape[1]))
        return self._logits[: logits.shape[0]].copy_(logits)


class PagedLlamaDecoder(LlamaFamilyDecoder):
    """`LlamaFamilyDecoder` over a paged KV cache, its decode step static and, on CUDA, graphed
    (module docstring). Prompt groups share their whole prompt blocks; there is no cascade."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_rows: int | None = None,
        owns_model: bool = False,
        reserve_tokens: int = 8192,
        static_shapes: bool | None = None,
        capture: bool | None = None,
        packed_prefill: bool | None = None,
    ):
        """`reserve_tokens`: KV-cache tokens the pool is first sized for (the engine's admission
        budget). `static_shapes` and `capture` (`StaticSteps`) default to on for CUDA, off elsewhere.
        `packed_prefill`: prompts prefilled end to end, attended by their boundaries (flash attention's
        variable-length kernel) instead of padded under a mask; default on for CUDA in half precision
        (the kernel's), off elsewhere (the padded path's numbers are the default decoder's)."""
        self._reserve_tokens = reserve_tokens
        on_cuda = next(model.parameters()).device.type == "cuda"
        self._capture = on_cuda if capture is None else capture
        super().__init__(model, max_rows=max_rows, owns_model=owns_model)
        capture = self._capture
        self.steps = StaticSteps(
            self._step,
            max_rows=max_rows or 64,
            block=PagedKVCache.BLOCK,
            static_shapes=capture or (on_cuda if static_shapes is None else static_shapes),
            capture=capture,
        )
        dtype = next(model.parameters()).dtype
        self.packed_prefill = (
            on_cuda and dtype in (torch.bfloat16, torch.float16) if packed_prefill is None else packed_prefill
        )
        # A graph reads the rotary table and the positions at fixed addresses: built whole, once. The
        # positions cover the widest block table, whose width is a power of two past the context.
        super()._grow_rotation(self.max_positions)
        widest = 1 << (-(-self.max_positions // PagedKVCache.BLOCK) - 1).bit_length()
        self._positions = torch.arange(widest * PagedKVCache.BLOCK, device=self.device)

    def _grow_rotation(self, positions: int) -> None:
        """Nothing grows: the table covers the context from the start (prompts are checked against it)."""

    def _new_cache(self, config, first: torch.Tensor, max_rows: int | None) -> PagedKVCache:
        return PagedKVCache(
            num_layers=config.num_hidden_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            device=first.device,
            dtype=first.dtype,
            reserve_tokens=self._reserve_tokens,
            max_rows=max_rows or 64,
            kept_on_cuda=self._capture,  # its graphs, captured once, serve every batch
        )

    def reset(self) -> None:
        self.cache.reset()
        if self.cache.pool_k is None:
            self.steps.forget()

    def prefill(
        self, prompts: list[list[int]], copies: list[int], max_new_tokens: list[int] | None = None
    ) -> torch.Tensor:
        del max_new_tokens  # blocks are taken as rows grow
        plan = self.cache.add_rows([len(p) for p in prompts], copies)
        if self.packed_prefill:
            return self._packed_prefill(prompts, plan)
        return self._padded_prefill(
            prompts, lambda layer, keys, values: plan.write(self.cache, layer, keys, values)
        )

    def _packed_prefill(self, prompts: list[list[int]], plan: PrefillPlan) -> torch.Tensor:
        lengths = [len(p) for p in prompts]
        starts = list(itertools.accumulate(lengths, initial=0))
        values = list_tensor(
            [*(t for p in prompts for t in p), *(i for n in lengths for i in range(n)), *starts],
            torch.int64,
            self.device,
        )
        total = starts[-1]
        ids, positions, cu = values[:total], values[total : 2 * total], values[2 * total :]
        return self.forward.packed_prefill(
            self.weights,
            ids,
            cu.to(torch.int32),
            max(lengths),
            self._rotation[positions, None],
            lambda layer, keys, values: plan.write_packed(self.cache, layer, keys, values, cu),
        )

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        assert tokens.shape == (cache.num_rows,)
        cache.prepare_step()
        span = max([*cache.row_lengths, 1])
        logits = self.steps.run(tokens, cache.lengths, cache.table, span, cache.version)
        cache.advance()
        return logits

    def _step(
        self, tokens: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor, span: int
    ) -> torch.Tensor:
        """The decode function `StaticSteps` runs: rows attend their first `span` positions, read
        through `table`, and write their new keys and values at position ``lengths[row]``."""
        return self.forward.step(
            self.weights,
            tokens,
            lengths,
            self._positions[:span],
            self._rotation,
            _PagedRows(self.cache, table, lengths, span),
            None,
        )


class _PagedRows(NamedTuple):
    """`RowCache` over the paged pool: each row's positions through its block-table row."""

    cache: PagedKVCache
    table: torch.Tensor  # (B, width)
    lengths: torch.Tensor  # (B,)
    span: int

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self.cache.gather(self.cache.pool_k[layer], self.table, self.span),
            self.cache.gather(self.cache.pool_v[layer], self.table, self.span),
        )

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        block = self.cache.BLOCK
        blocks = self.table.gather(1, (self.lengths // block)[:, None]).squeeze(1)
        offsets = self.lengths % block
        self.cache.pool_k[:, blocks, :, offsets] = keys
        self.cache.pool_v[:, blocks, :, offsets] = values
