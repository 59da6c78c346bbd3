"""The memory plan of a run, printed before it starts, and the peak memory measured at each step.

`plan_memory` estimates what one rank holds: the master weights, their gradients and AdamW's two
moments (all sharded over the ranks under torchrun), the compute-dtype copies the passes use
(autocast's casts in one process; FSDP2's gathered blocks over several), the KL reference model,
the distillation teacher (in its own dtype, sharded like the reference), or with LoRA the frozen base in the compute dtype, float32 adapters and the gradients and moments
of the adapters alone (no reference copy: the reference is the base with the adapters off),
the activations of the largest micro-batch, and on rank 0 (which scores) the reward models the
environments name on this device, and the embedded engine's weights and KV
cache or a colocated vLLM engine (its `gpu_memory_utilization` share of the GPU; on the CPU build its
weights and KV cache), which must fit both beside the update and, without the update's activations
and gradients, while it generates (asleep during the update, it counts only then), and, on CPU
under torchrun, the whole weights rank 0 gathers for a checkpoint's folder (on a GPU they are
gathered into host memory). The trainer refuses to start when the plan exceeds the
device's memory, naming the settings that would fit (`MemoryPlan.check`).

On CUDA the plan also sizes the embedded engine where the config leaves it unset (`size_engine`), as
vLLM's `gpu_memory_utilization` sizes vLLM's: its KV cache takes what every other term leaves of
`inference.memory_utilization` x the GPU's memory, and it decodes every sample a step has in flight
at once. On CPU the defaults stay (`inference.max_batch_tokens` 8192, `max_concurrent` 64).

Activations are what autograd keeps of a decoder-only transformer, counted per token and layer from
the tensors it saves (census on CPU and on an H200, docs/benchmarks.md): in the compute dtype, two
hidden-wide tensors (the inputs of the output and down projections' neighbours), three more under
autocast (its casts of the norms' outputs), four
attention-wide ones (q, k and v, repeated to every head, as SDPA gets them with a mask, and its
output), four of the MLP's width (gate, up, the activation, its product); and two hidden-wide
tensors per RMS norm in the residual stream's dtype (the master dtype under autocast, the compute
dtype under FSDP2). With activation checkpointing, each layer's input alone, plus one layer's
activations while it is recomputed. Packed rows add one additive attention mask per micro-batch
(rows x row length squared). The LM head's logits are computed in chunks
(`llmrl.algorithms.logprobs`), so they add a bounded amount. AdamW's step makes one temporary the
size of the parameters (the foreach square root of the second moment). On CPU the process's own
memory before the model loads (Python, torch, transformers) is part of the plan, as it is part of
the resident set measured.
"""

from __future__ import annotations

import dataclasses
import os
import resource
from pathlib import Path

import torch

from llmrl.algorithms.logprobs import CHUNK_ELEMENTS
from llmrl.config import DEFAULT_ENGINE_TOKENS, ConfigError
from llmrl.models.shape import ModelShape

GB = 1e9


@dataclasses.dataclass(frozen=True)
class MemorySettings:
    """The run settings the plan depends on."""

    master_dtype: torch.dtype
    compute_dtype: torch.dtype
    world_size: int
    micro_batch_tokens: int
    row_tokens: int
    """Longest packed row (`training.pack_row_tokens`): a micro-batch's attention mask is rows x row length^2."""
    activation_checkpointing: bool
    reference_model: bool
    engine_tokens: int | None
    """KV-cache tokens of the embedded engine on rank 0; None when inference is elsewhere."""
    lora: LoraSizes | None = None
    """The adapters' sizes when LoRA trains (`model.lora`); None: every parameter trains."""
    colocated: ColocatedEngine | None = None
    """vLLM's engine in every process (`inference.vllm.mode: colocate`); None: no such engine."""
    teacher_bytes: int = 0
    """The distillation teacher's weights, whole (`distillation.teacher`, in `teacher_dtype`); 0: none."""
    reward_model_bytes: int = 0
    """Weights of the reward models the environments name on this device (rank 0's: it scores); 0: none."""


HEAD_BYTES_PER_LOGIT = 3 * 4
"""Bytes the LM head holds per logit of a chunk: float32 logits, their log-softmax and its gradient."""
GPU_CHUNK_TOKENS = 1024
"""Most tokens in an LM-head chunk on CUDA: from about a thousand tokens on, the head's matmul (tokens x
hidden x vocabulary) does enough arithmetic per byte it reads to be bound by the card's arithmetic
rather than its memory; larger chunks only take memory."""
MOST_SIZED_ROWS = 1024
"""Most rows `size_engine` gives the embedded engine (a step of 64 prompts x 8 samples with a lag of 1)."""


@dataclasses.dataclass(frozen=True)
class EngineSizing:
    """The embedded engine's size where the plan chose it from the GPU's memory (`size_engine`)."""

    rows: int
    sized: tuple[str, ...]
    """The `inference` settings chosen here (`max_batch_tokens`, `max_concurrent`); the others were set."""
    utilization: float


@dataclasses.dataclass(frozen=True)
class ColocatedEngine:
    gpu_share: float
    """Share of the GPU the engine takes whole (`gpu_memory_utilization`: its weights, KV cache, graphs)."""
    cpu_kv_cache_bytes: int
    """KV cache of vLLM's CPU build (`cpu_kv_cache_gib`), beside its copy of the weights."""
    sleeps: bool
    """It releases its memory while the trainer updates (`sleep_level`)."""


@dataclasses.dataclass(frozen=True)
class LoraSizes:
    adapter: int
    """Parameters of the adapters (float32, trained)."""
    adapted: int
    """Parameters of the base weights they adapt (the embedded engine keeps a copy to merge onto)."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes one rank holds, by what holds them; `rank0` adds the embedded engine."""

    shape: ModelShape
    settings: MemorySettings
    device: str
    device_bytes: int
    baseline_bytes: int
    """The process before the model loads (CPU only: torch and Python count in its resident set)."""
    engine_sizing: EngineSizing | None = None
    """How `size_engine` sized the embedded engine; None: as configured (or no embedded engine)."""

    def terms(self, *, rank0: bool, phase: str = "update") -> dict[str, int]:
        """What holds memory during the update (`phase` "update") or, beside a colocated engine, while
        it generates ("generation": no activations or gradients, and the engine awake)."""
        shape, s = self.shape, self.settings
        master, compute = s.master_dtype.itemsize, s.compute_dtype.itemsize
        shards = shape.parameters / s.world_size
        if s.lora is not None:  # a frozen base in the compute dtype; float32 adapters alone train
            adapters = s.lora.adapter * 4 / s.world_size
            terms = {
                "parameters": shards * compute + adapters,
                "gradients": adapters,
                "optimizer": 3 * adapters,  # AdamW's two moments and its step's temporary
            }
        else:
            terms = {
                "parameters": shards * master,
                "gradients": shards * master,
                "optimizer": 3 * shards * master,
            }
        if s.world_size > 1:  # the root's parameters stay gathered; two blocks at a time with prefetch
            terms["gathered"] = (shape.outside_blocks + 2 * shape.largest_block) * compute
        elif compute != master and s.lora is None:  # autocast's casts, kept for the backward pass
            terms["gathered"] = shape.parameters * compute
        if s.reference_model:
            terms["reference"] = shape.parameters / s.world_size * compute
        if s.teacher_bytes:
            terms["teacher"] = s.teacher_bytes / s.world_size
        if rank0 and s.reward_model_bytes:
            terms["reward models"] = s.reward_model_bytes
        terms["activations"] = self._activations()
        if rank0 and s.engine_tokens is not None:
            terms["engine"] = shape.parameters * compute + s.engine_tokens * self.kv_bytes_per_token
            if s.lora is not None:  # the base values of the weights adapter deltas are merged onto
                terms["engine"] += s.lora.adapted * compute
        if rank0 and s.world_size > 1 and self.device == "cpu" and s.lora is None:
            # a checkpoint's Hugging Face folder gathers every bucket; a weight sync holds one at a time
            # (on a GPU they are gathered into host memory; LoRA gathers its adapters alone)
            terms["gathered weights"] = shape.parameters * compute
        if self.device == "cpu":
            terms["process"] = self.baseline_bytes
        engine = s.colocated
        if engine is not None:
            if phase == "generation":
                del terms["activations"], terms["gradients"]
            if phase == "generation" or not engine.sleeps:
                terms["vLLM colocated"] = (
                    engine.gpu_share * self.device_bytes
                    if self.device == "cuda"
                    else shape.parameters * compute + engine.cpu_kv_cache_bytes
                )
        return {name: int(value) for name, value in terms.items()}

    @property
    def kv_bytes_per_token(self) -> int:
        """The embedded engine's KV cache per token: keys and values of every layer, in the compute dtype."""
        return 2 * self.shape.layers * self.shape.kv_channels * self.settings.compute_dtype.itemsize

    def phases(self) -> tuple[str, ...]:
        """The phases whose memory must fit: the update, and generation beside a colocated engine."""
        return ("update", "generation") if self.settings.colocated is not None else ("update",)

    def _activations(self) -> float:
        shape, s = self.shape, self.settings
        tokens = s.micro_batch_tokens
        per_layer = self._layer_activations()
        if s.activation_checkpointing:
            kept = tokens * shape.layers * shape.hidden * self._stream_dtype.itemsize + per_layer
        else:
            kept = per_layer * shape.layers
        mask = tokens * min(s.row_tokens, tokens) * s.compute_dtype.itemsize
        # chunked LM head: a chunk's float32 logits, log-softmax and gradient, plus the last hidden states
        head = HEAD_BYTES_PER_LOGIT * self._chunk_logits() + tokens * shape.hidden * 4
        return kept + mask + head

    @property
    def _stream_dtype(self) -> torch.dtype:
        """The residual stream's dtype: the master dtype under autocast, the compute dtype under FSDP2."""
        s = self.settings
        return s.compute_dtype if s.world_size > 1 else s.master_dtype

    def _layer_activations(self) -> int:
        """What autograd keeps of one layer for the largest micro-batch (no checkpointing)."""
        shape, s = self.shape, self.settings
        stream = self._stream_dtype
        hidden_wide = 5 if stream != s.compute_dtype else 2  # autocast keeps its casts of the norms' outputs
        return s.micro_batch_tokens * (
            s.compute_dtype.itemsize
            * (hidden_wide * shape.hidden + 4 * shape.attention_width + 4 * shape.intermediate)
            + 2 * 2 * shape.hidden * stream.itemsize
        )

    @property
    def logits_chunk_tokens(self) -> int | None:
        """Tokens per LM-head chunk of the trainer's passes. On CUDA, as many as one layer's activations
        hold in logits (each costs `HEAD_BYTES_PER_LOGIT`), at least `CHUNK_ELEMENTS` logits' worth, at
        most `GPU_CHUNK_TOKENS` and a micro-batch: a wide vocabulary's chunks of ~100 tokens make small
        matmuls that leave a GPU idle. None on CPU: the chunks of `CHUNK_ELEMENTS` logits, whose numbers
        the CPU runs keep."""
        if self.device != "cuda":
            return None
        vocab = self.shape.vocab
        by_layer = self._layer_activations() // (HEAD_BYTES_PER_LOGIT * vocab)
        return min(
            self.settings.micro_batch_tokens, max(1, CHUNK_ELEMENTS // vocab, min(by_layer, GPU_CHUNK_TOKENS))
        )

    def _chunk_logits(self) -> int:
        tokens = self.settings.micro_batch_tokens
        chunk = self.logits_chunk_tokens
        return min(CHUNK_ELEMENTS if chunk is None else chunk * self.shape.vocab, tokens * self.shape.vocab)

    def total(self, *, rank0: bool = True, phase: str = "update") -> int:
        return sum(self.terms(rank0=rank0, phase=phase).values())

    def fits(self) -> bool:
        return all(self.total(rank0=True, phase=phase) <= self.device_bytes for phase in self.phases())

    def render(self) -> str:
        """The plan as a small table (GB), rank 0 beside the other ranks when there are several."""
        ranks = [("rank 0", True, "update")] + (
            [("other ranks", False, "update")] if self.settings.world_size > 1 else []
        )
        if self.settings.colocated is not None:
            ranks = [("updating", True, "update"), ("generating", True, "generation")]
        columns = [self.terms(rank0=rank0, phase=phase) for _, rank0, phase in ranks]
        names = list(dict.fromkeys(name for column in columns for name in column))
        width = max(len(n) for n in [*names, "total"]) + 2
        lines = [
            f"memory plan per rank ({self.device}, {self.device_bytes / GB:.1f} GB; "
            f"{self.shape.parameters / 1e6:.1f}M parameters, {self.settings.world_size} process(es)):",
            " " * width + "".join(f"{label:>14}" for label, _, _ in ranks),
        ]
        for name in names:
            lines.append(
                f"{name:<{width}}" + "".join(f"{column.get(name, 0) / GB:>11.3f} GB" for column in columns)
            )
        lines.append(f"{'total':<{width}}" + "".join(f"{sum(c.values()) / GB:>11.3f} GB" for c in columns))
        sizing, tokens = self.engine_sizing, self.settings.engine_tokens
        if sizing is not None and tokens is not None:
            lines.append(
                f"embedded engine: {sizing.rows} rows, {tokens} KV-cache tokens "
                f"({tokens * self.kv_bytes_per_token / GB:.1f} GB); "
                + " and ".join(f"inference.{name}" for name in sizing.sized)
                + f" sized from the GPU (memory_utilization {sizing.utilization})"
            )
        return "\n".join(lines)

    def check(self) -> None:
        """Raise `ConfigError` with the plan and the settings that would fit when it does not fit."""
        if self.fits():
            return
        needed = max(self.total(phase=phase) for phase in self.phases())
        raise ConfigError(
            f"the run needs about {needed / GB:.1f} GB per rank but {self.device} has "
            f"{self.device_bytes / GB:.1f} GB\n{self.render()}\n{self._what_would_fit()}"
        )

    def _what_would_fit(self) -> str:
        s = self.settings
        checkpointing, elsewhere = "training.activation_checkpointing: true", "inference on vLLM or a server"
        options: list[tuple[str, MemorySettings]] = []
        if not s.activation_checkpointing:
            options.append((checkpointing, dataclasses.replace(s, activation_checkpointing=True)))
        tokens = s.micro_batch_tokens // 2  # the largest halving that fits, if any
        while tokens >= 256 and not self._fits_with(dataclasses.replace(s, micro_batch_tokens=tokens)):
            tokens //= 2
        if tokens >= 256:
            options.append(
                (f"training.micro_batch_tokens: {tokens}", dataclasses.replace(s, micro_batch_tokens=tokens))
            )
        if s.master_dtype != s.compute_dtype:
            compute = str(s.compute_dtype).removeprefix("torch.")
            options.append(
                (
                    f"training.master_dtype: {compute} (loses small updates)",
                    dataclasses.replace(s, master_dtype=s.compute_dtype),
                )
            )
        if s.engine_tokens is not None:
            options.append((elsewhere, dataclasses.replace(s, engine_tokens=None)))
        if s.colocated is not None and not s.colocated.sleeps and self.device == "cuda":
            asleep = dataclasses.replace(s.colocated, sleeps=True)
            options.append(("inference.vllm.sleep_level: 2", dataclasses.replace(s, colocated=asleep)))
        processes = self._processes_that_fit(s)
        if processes is not None:
            options.append(
                (f"{processes} processes (torchrun)", dataclasses.replace(s, world_size=processes))
            )
        fitting = [label for label, settings in options if self._fits_with(settings)]
        if fitting:
            return "each of these alone would fit: " + "; ".join(fitting[:4])
        # Together, cheapest first: checkpointing, inference elsewhere, then as few more processes as fit.
        combined = dataclasses.replace(s, activation_checkpointing=True, engine_tokens=None)
        processes = self._processes_that_fit(combined)
        if processes is None:
            return "no combination of these settings fits up to 1024 processes: use a smaller model or larger devices"
        changes = [
            label
            for label, needed in (
                (checkpointing, not s.activation_checkpointing),
                (elsewhere, s.engine_tokens is not None),
                (f"{processes} processes (torchrun)", processes > s.world_size),
            )
            if needed
        ]
        return "no single change fits; together these would: " + "; ".join(changes)

    def _processes_that_fit(self, settings: MemorySettings) -> int | None:
        """The fewest processes (doubling from `settings.world_size`, up to 1024) with which `settings`
        fit."""
        processes = settings.world_size
        while processes <= 1024:
            if self._fits_with(dataclasses.replace(settings, world_size=processes)):
                return processes
            processes *= 2
        return None

    def _fits_with(self, settings: MemorySettings) -> bool:
        return dataclasses.replace(self, settings=settings).fits()


def plan_memory(model: torch.nn.Module, settings: MemorySettings, device: str) -> MemoryPlan:
    """The memory plan of training `model` (on the meta device or loaded) with `settings` on `device`."""
    return MemoryPlan(
        ModelShape.of(model),
        settings,
        device,
        device_memory(device),
        resident_bytes() if device == "cpu" else 0,
    )


def size_engine(
    plan: MemoryPlan,
    *,
    max_batch_tokens: int | None,
    max_concurrent: int | None,
    rows_in_flight: int,
    utilization: float,
) -> MemoryPlan:
    """`plan` with the embedded engine sized from the GPU's memory where the config leaves it unset (None).

    KV-cache tokens: what the plan's other terms (the engine's weights among them, in whichever phase
    needs more) leave of `utilization` x the device's memory, and never fewer than the CPU default, so
    that a GPU without that room fails the plan's check as before. Rows: `rows_in_flight` (every sample
    a step has in flight), at most `MOST_SIZED_ROWS`. Settings given explicitly stay as they are.
    """
    if max_batch_tokens is not None and max_concurrent is not None:
        return plan
    sized = []
    tokens = max_batch_tokens
    if tokens is None:
        without_cache = dataclasses.replace(
            plan, settings=dataclasses.replace(plan.settings, engine_tokens=0)
        )
        others = max(without_cache.total(phase=phase) for phase in plan.phases())
        tokens = max(
            int((utilization * plan.device_bytes - others) // plan.kv_bytes_per_token), DEFAULT_ENGINE_TOKENS
        )
        sized.append("max_batch_tokens")
    rows = max_concurrent
    if rows is None:
        rows = max(1, min(rows_in_flight, MOST_SIZED_ROWS))
        sized.append("max_concurrent")
    return dataclasses.replace(
        plan,
        settings=dataclasses.replace(plan.settings, engine_tokens=tokens),
        engine_sizing=EngineSizing(rows, tuple(sized), utilization),
    )


def device_memory(device: str) -> int:
    """Bytes of memory of `device` for this process: its GPU, or its share of the machine's RAM (its
    cgroup's limit when lower), which the processes torchrun started on this machine share."""
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.is_file() and limit.read_text().strip().isdigit():
        physical = min(physical, int(limit.read_text()))
    return physical // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def resident_bytes() -> int:
    """This process's resident set now."""
    return _process_status("VmRSS")


class PeakMemory:
    """Peak memory of this process since the last `take()`: CUDA's allocator peak on a GPU, else the
    resident set's high-water mark (reset through /proc/self/clear_refs where Linux allows)."""

    def __init__(self, device: str):
        self.device = device
        self._resettable = device == "cpu" and _reset_rss_peak()
        self.take()

    def take(self) -> float:
        """The peak in GB since the previous call, and start a new period."""
        if self.device == "cuda":
            peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return peak / GB
        peak = _process_status("VmHWM")
        if self._resettable:
            _reset_rss_peak()
        return peak / GB


def _process_status(field: str) -> int:
    """A memory field of /proc/self/status in bytes (the lifetime peak where there is no such file)."""
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines() if status.is_file() else ():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # "5" resets the high-water mark only
    except OSError:
        return False
    return True
