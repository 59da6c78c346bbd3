"""Packed vs padded training throughput, and memory of chunked vs naive logprobs.

    python bench/packing.py [--repeats 2] [--threads 1] [--bin-tokens 512 1024 2048]

1. Throughput: forward + backward of the tiny Qwen2 (`load_model("tiny://arithmetic")` when that
   exists, else a randomly initialised model of the same shape; speed does not depend on the
   weights) on a GRPO-shaped batch: 8 prompts x 8 samples, prompts of ~20 tokens, completion lengths
   spread widely (a long-tailed draw between 4 and 400 tokens, like real rollouts). Both layouts go
   through the same `token_logprobs` code and differ only in layout:
   - padded: one GRPO group (8 sequences) per micro-batch, right-padded to its longest sequence;
   - packed: first-fit-decreasing bins of `--bin-tokens` tokens, one row each.
   Reported as real (non-padding) tokens per second, best of `--repeats` interleaved passes, both
   per wall-clock second and per CPU second of this process (the CPU figure, on one thread, is the
   one that survives other processes competing for the cores).
   On CPU, SDPA applies the packed block-diagonal mask densely (masked blocks are computed, then
   discarded), so attention cost grows with the bin size: that is why several sizes are shown.
2. Memory: peak resident memory added by computing logprobs (+ backward) of 4096 tokens over a
   32k vocabulary, naive (full logits, log_softmax, gather) vs `logprobs_from_hidden` (chunked,
   LM head per chunk, default chunk size). Each variant runs in a fresh subprocess; the figure is
   the process's peak RSS (VmHWM, reset through /proc/self/clear_refs once the inputs exist) minus
   its RSS at that point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from llmrl.algorithms.logprobs import logprobs_from_hidden, token_logprobs
from llmrl.algorithms.packing import build_batch, pack, packing_efficiency

GROUPS, GROUP_SIZE = 8, 8
MEMORY_TOKENS, MEMORY_VOCAB, MEMORY_HIDDEN = 4096, 32768, 256


def tiny_model() -> tuple[torch.nn.Module, str]:
    """The project's tiny model if `llmrl.models.load_model` exists, else a same-shape random Qwen2."""
    try:
        from llmrl.models import load_model
    except ImportError:
        load_model = None
    if load_model is not None:
        model, _ = load_model("tiny://arithmetic")
        return model.float().train(), "tiny://arithmetic (load_model)"
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(
        config
    ).train(), "random Qwen2 with the tiny model's shape (load_model not available)"


def grpo_batch(vocab: int) -> tuple[list[list[int]], list[list[bool]]]:
    """64 sequences: 8 groups share a ~20-token prompt; completions 4..400 tokens, long-tailed."""
    generator = torch.Generator().manual_seed(0)
    sequences, masks = [], []
    for _ in range(GROUPS):
        prompt = torch.randint(
            0, vocab, (int(torch.randint(16, 25, (1,), generator=generator)),), generator=generator
        )
        for _ in range(GROUP_SIZE):
            # Exponential with mean 70, clipped: most completions are short, a few run long.
            length = int(torch.empty(1).exponential_(1 / 70, generator=generator).clamp(4, 400))
            completion = torch.randint(0, vocab, (length,), generator=generator)
            sequences.append(prompt.tolist() + completion.tolist())
            masks.append([False] * len(prompt) + [True] * length)
    return sequences, masks


def train_pass(model: torch.nn.Module, batches) -> None:
    for batch in batches:
        logprobs, _ = token_logprobs(model, batch, temperature=1.0)
        (-logprobs.sum()).backward()
    model.zero_grad(set_to_none=True)


def throughput(repeats: int, bin_sizes: list[int]) -> None:
    model, which = tiny_model()
    sequences, masks = grpo_batch(model.config.vocab_size)
    lengths = [len(s) for s in sequences]
    real_tokens = sum(lengths)
    print(f"model: {which}")
    print(
        f"batch: {len(sequences)} sequences, {real_tokens} real tokens, "
        f"lengths {min(lengths)}..{max(lengths)} (median {int(statistics.median(lengths))})"
    )
    groups = [list(range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE)) for g in range(GROUPS)]
    layouts = {"padded": [build_batch(sequences, [[i] for i in group], masks) for group in groups]}
    slots = sum(b.input_ids.numel() for b in layouts["padded"])
    print(
        f"padded: {GROUPS} micro-batches (one group of {GROUP_SIZE} rows each), {slots} token slots, "
        f"{real_tokens / slots:.1%} of them real"
    )
    for bin_tokens in bin_sizes:
        bins = pack(lengths, bin_tokens)
        layouts[f"packed {bin_tokens}"] = [build_batch(sequences, [b], masks) for b in bins]
        print(
            f"packed {bin_tokens}: {len(bins)} bins of <= {bin_tokens} tokens, packing efficiency "
            f"{packing_efficiency(lengths, bins, bin_tokens):.1%} (real tokens / bin tokens)"
        )

    train_pass(model, [batches[0] for batches in layouts.values()])  # warm-up: first-call allocations
    wall: dict[str, list[float]] = {name: [] for name in layouts}
    cpu: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(repeats):  # interleaved, so that load from other processes hits all layouts alike
        for name, batches in layouts.items():
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            train_pass(model, batches)
            wall[name].append(time.perf_counter() - wall_start)
            cpu[name].append(time.process_time() - cpu_start)
    print(
        f"\ntraining tokens/s, forward+backward, best of {repeats} "
        f"(per wall-clock second | per CPU second of this process, {torch.get_num_threads()} thread(s)):"
    )
    base_wall, base_cpu = min(wall["padded"]), min(cpu["padded"])
    for name in layouts:
        print(
            f"  {name:12s} {real_tokens / min(wall[name]):8,.0f} | {real_tokens / min(cpu[name]):8,.0f}"
            f"   speed-up vs padded {base_wall / min(wall[name]):.2f}x | {base_cpu / min(cpu[name]):.2f}x"
        )


def measure_memory(variant: str) -> dict:
    """Run in a fresh process: peak RSS growth (MB) of one logprob forward(+backward) pass."""
    torch.manual_seed(0)
    hidden = torch.randn(MEMORY_TOKENS, MEMORY_HIDDEN, requires_grad=True)
    weight = (0.05 * torch.randn(MEMORY_VOCAB, MEMORY_HIDDEN)).requires_grad_()
    targets = torch.randint(0, MEMORY_VOCAB, (MEMORY_TOKENS,))
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)  # gradients count as inputs
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS, forgetting import-time spikes
    baseline_kb = _status_kb("VmRSS")
    start = time.perf_counter()
    if variant == "naive":
        logits = hidden @ weight.T  # (4096, 32768)
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    else:
        logprobs, _ = logprobs_from_hidden(hidden, weight, targets)
    logprobs.sum().backward()
    seconds = time.perf_counter() - start
    return {"peak_mb": (_status_kb("VmHWM") - baseline_kb) / 1024, "seconds": seconds}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory() -> None:
    full_logits_mb = MEMORY_TOKENS * MEMORY_VOCAB * 4 / 2**20
    print(
        f"\nlogprobs of {MEMORY_TOKENS} tokens over a {MEMORY_VOCAB} vocab (hidden {MEMORY_HIDDEN}), "
        f"forward+backward; one float32 [tokens, vocab] tensor is {full_logits_mb:.0f} MB"
    )
    peaks = {}
    for variant in ("naive", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", variant], check=True, capture_output=True, text=True
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        peaks[variant] = result["peak_mb"]
        label = "naive log_softmax+gather" if variant == "naive" else "chunked token_logprobs path"
        print(f"{label}: peak +{result['peak_mb']:.0f} MB, {result['seconds']:.1f} s")
    print(f"memory reduction: {peaks['naive'] / peaks['chunked']:.1f}x lower peak")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--bin-tokens", type=int, nargs="+", default=[512, 1024, 2048], help="packed bin sizes to compare"
    )
    parser.add_argument("--memory-child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(measure_memory(args.memory_child)))
        return
    throughput(args.repeats, args.bin_tokens)
    memory()


if __name__ == "__main__":
    main()
