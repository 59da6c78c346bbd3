"""Generation throughput: LocalEngine against Hugging Face `generate` on the same prompts.

    python bench/generation.py [--model tiny://arithmetic] [--repeats 9] [--threads N] [--quick]
                               [--cuda-graphs auto|on|off]

Workloads (completion tokens per second, higher is better):

  grpo       8 arithmetic prompts x group size 8, exactly 64 new tokens each (eos ignored), T=1.0
  natural    the same shape, stopping at eos (the arithmetic task as training samples it)
  long-tail  128 prompts whose completion lengths vary 8x (16..128 tokens, eos ignored), at most
             64 sequences at once

The reference is what TRL does without vLLM: `model.generate` with left padding and a KV cache,
64 rows per call (each prompt repeated group-size times); a call runs until its longest row is
done, and only the tokens each row asked for count. Engine and reference run alternately, each
repeat measuring both, so the printed ratio is taken within one repeat on a machine that others
share (the median over repeats is shown, and the middle half of them: the VM's speed moves
within a second, so single repeats scatter widely). Each engine is built once per workload and
serves all its repeats, as the trainer's engine serves every step; every runner runs once
untimed first.

Also printed: achieved model FLOP/s as a fraction of a fp32 matmul peak measured in the same run
(useful FLOPs only: weights x tokens plus causal attention, no padding or recomputation), the
engine's cost per sample as the group size grows 1 -> 16 with a 256-token shared prompt, and
peak memory (the engine's KV cache, `generate`'s cache at its largest, the process's peak RSS).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from llmrl.inference.decoder import build_decoder
from llmrl.inference.engine import LocalEngine
from llmrl.inference.interface import run_in_new_loop
from llmrl.models import load_model
from llmrl.models.shape import ModelShape
from llmrl.rewards.arithmetic import prompt_messages, sample_problems
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest

ROWS_PER_CALL = 64
T = TypeVar("T")


@dataclass
class Group:
    """One chat prompt, its template ids (what both runners see) and each sample's token budget."""

    messages: list[ChatMessage]
    prompt_ids: list[int]
    max_tokens: int
    samples: int


@dataclass
class Workload:
    name: str
    groups: list[Group]
    ignore_eos: bool
    temperature: float = 1.0


@dataclass
class Run:
    seconds: float
    completions: list[tuple[int, int]]  # (prompt length, completion length) per sample
    cache_bytes: int

    @property
    def tokens(self) -> int:
        return sum(c for _, c in self.completions)


# ---------------------------------------------------------------------------------------------
# Workloads


def chat_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [m.model_dump() for m in messages], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def chat_group(tokenizer, content: str, max_tokens: int, samples: int) -> Group:
    messages = [ChatMessage(role="user", content=content)]
    return Group(messages, chat_ids(tokenizer, messages), max_tokens, samples)


def arithmetic_groups(tokenizer, count: int, seed: int, max_tokens: list[int], samples: int) -> list[Group]:
    problems = sample_problems(count, digits=2, seed=seed)
    return [
        chat_group(tokenizer, prompt_messages(p)[0].content, m, samples)
        for p, m in zip(problems, max_tokens, strict=True)
    ]


def workloads(tokenizer, quick: bool) -> list[Workload]:
    groups, size, tail = (4, 8, 64) if quick else (8, 8, 128)
    rng = random.Random(3)
    return [
        Workload("grpo", arithmetic_groups(tokenizer, groups, 1, [64] * groups, size), ignore_eos=True),
        Workload("natural", arithmetic_groups(tokenizer, groups, 2, [64] * groups, size), ignore_eos=False),
        Workload(
            "long-tail",
            arithmetic_groups(tokenizer, tail, 3, [rng.randint(16, 128) for _ in range(tail)], 1),
            ignore_eos=True,
        ),
    ]


def long_prompt_group(tokenizer, length: int, samples: int) -> Group:
    """A chat prompt of about `length` tokens (a list of sums), `samples` samples of 64 tokens."""
    sums = [f"{a} + {b} = {a + b}." for a in range(10, 99) for b in (7, 31, 58)]
    low, high = 1, len(sums)
    while low < high:  # the most sums whose rendered prompt fits in `length` tokens
        middle = (low + high + 1) // 2
        if len(chat_group(tokenizer, " ".join(sums[:middle]), 64, samples).prompt_ids) <= length:
            low = middle
        else:
            high = middle - 1
    return chat_group(tokenizer, " ".join(sums[:low]), 64, samples)


# ---------------------------------------------------------------------------------------------
# Runners


def new_engine(model, tokenizer, workload: Workload, cuda_graphs: str = "auto") -> LocalEngine:
    return LocalEngine(
        model,
        tokenizer,
        max_concurrent=ROWS_PER_CALL,
        seed=0,
        eos_token_ids=() if workload.ignore_eos else None,
        cuda_graphs=cuda_graphs,
    )


def run_engine(engine: LocalEngine, workload: Workload) -> Run:
    """All groups submitted at once (at most 64 sequences decode together)."""
    requests = [
        InferenceRequest(
            prompt=g.messages,
            n=g.samples,
            generation_args=GenerationArgs(temperature=workload.temperature, max_tokens=g.max_tokens),
        )
        for g in workload.groups
    ]

    async def generate_all():
        return await asyncio.gather(*(engine.agenerate(r) for r in requests))

    started = time.perf_counter()
    results = run_in_new_loop(generate_all())  # as the trainer runs its agents
    seconds = time.perf_counter() - started
    completions = [(len(r.prompt_token_ids), len(r.token_ids)) for responses in results for r in responses]
    assert [len(r[0].prompt_token_ids) for r in results] == [len(g.prompt_ids) for g in workload.groups]
    return Run(seconds, completions, engine.stats.peak_cache_bytes)


def run_generate(model, tokenizer, workload: Workload) -> Run:
    """TRL-style: each prompt repeated per sample, left-padded batches of 64 rows, run to the longest.

    Timed from the chat messages on, as the engine's runs are: templating each prompt (once per
    group), padding and generating."""
    eos_ids = set(_eos_ids(model, tokenizer))
    completions, cache_bytes = [], 0
    started = time.perf_counter()
    prompts = [chat_ids(tokenizer, g.messages) for g in workload.groups]
    rows = [
        (ids, g.max_tokens) for ids, g in zip(prompts, workload.groups, strict=True) for _ in range(g.samples)
    ]
    for start in range(0, len(rows), ROWS_PER_CALL):
        batch = rows[start : start + ROWS_PER_CALL]
        padded = tokenizer.pad(
            {"input_ids": [ids for ids, _ in batch]}, padding_side="left", return_tensors="pt"
        )
        with torch.inference_mode():
            out = model.generate(
                **padded,
                do_sample=True,
                temperature=workload.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max(m for _, m in batch),
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=None if workload.ignore_eos else sorted(eos_ids),
                return_dict_in_generate=True,
            )
        cache_bytes = max(cache_bytes, _cache_bytes(out.past_key_values))
        new_tokens = out.sequences[:, padded["input_ids"].shape[1] :].tolist()
        for (ids, limit), tokens in zip(batch, new_tokens, strict=True):
            tokens = tokens[:limit]
            if not workload.ignore_eos:
                ends = [i for i, t in enumerate(tokens) if t in eos_ids]
                tokens = tokens[: ends[0] + 1] if ends else tokens
            completions.append((len(ids), len(tokens)))
    seconds = time.perf_counter() - started
    assert prompts == [g.prompt_ids for g in workload.groups]  # the engine's prompts, token for token
    return Run(seconds, completions, cache_bytes)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    generation_eos = model.generation_config.eos_token_id
    ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return sorted(i for i in ids if i is not None)


def _cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


# ---------------------------------------------------------------------------------------------
# FLOPs and peak


def model_flops(model, completions: list[tuple[int, int]], groups: list[Group]) -> float:
    """Useful forward FLOPs: 2 x weights per token, causal attention, each group's prompt once."""
    shape = ModelShape.of(model)
    body, head = shape.body, shape.lm_head
    flops = 0.0
    for group in groups:  # prefill: body on every prompt token, the head on the last one
        length = len(group.prompt_ids)
        flops += 2 * body * length + 2 * head + shape.attention_flops(length)
    for prompt, completion in completions:  # decode: every completion token but the last is fed back
        steps = completion - 1
        flops += 2 * (body + head) * steps + shape.attention_flops(steps, prompt)
    return flops


def matmul_peak(seconds: float = 2.0) -> float:
    """Best fp32 FLOP/s of a 1024^3 matmul over a few tries."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        began = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = max(best, 4 * 2 * 1024**3 / (time.perf_counter() - began))
    return best


# ---------------------------------------------------------------------------------------------
# Main


def decode_step_ms(model, repeats: int) -> dict[str, float]:
    """Median ms of one decode step of 64 rows (8 prompts x 8 samples, 18-token prompts, ~50 cached
    positions): the engine's decoder against ``model(...)`` with a transformers ``DynamicCache``."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (8, 18), generator=generator)
    with torch.inference_mode():  # as the engine's
        tokens = torch.randint(0, vocab, (64,), generator=generator)
    warmup, timed = 24, 16

    def engine_step(_: int) -> float:
        decoder = build_decoder(model)
        decoder.prefill(prompts.tolist(), [8] * 8)
        for _ in range(warmup):
            decoder.decode(tokens)
        began = time.perf_counter()
        for _ in range(timed):
            decoder.decode(tokens)
        return (time.perf_counter() - began) / timed

    def forward_step(_: int) -> float:
        cache = model(prompts.repeat_interleave(8, dim=0), use_cache=True).past_key_values
        for _ in range(warmup):
            model(tokens[:, None], past_key_values=cache, use_cache=True)
        began = time.perf_counter()
        for _ in range(timed):
            model(tokens[:, None], past_key_values=cache, use_cache=True)
        return (time.perf_counter() - began) / timed

    runners = {"engine": engine_step, "forward": forward_step}
    with torch.inference_mode():
        times = interleaved(repeats, runners)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def quartiles(values: list[float]) -> str:
    """First and third quartiles, as ``q1-q3``."""
    low, _, high = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return f"{low:>5.2f}-{high:<5.2f}"


def interleaved(repeats: int, runners: dict[str, Callable[[int], T]]) -> dict[str, list[T]]:
    """Each repeat runs every runner once (given the repeat index), alternating the order."""
    results: dict[str, list[T]] = {name: [] for name in runners}
    names = list(runners)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else reversed(names):
            gc.collect()
            torch.manual_seed(repeat)
            results[name].append(runners[name](repeat))
    return results


def compare(
    model, tokenizer, workload: Workload, repeats: int, cuda_graphs: str = "auto"
) -> dict[str, list[Run]]:
    """Interleaved runs of the engine and `generate`.

    The engine is built once and serves every repeat, as the trainer's engine serves every step;
    each runner runs once untimed before the repeats."""
    engine = new_engine(model, tokenizer, workload, cuda_graphs)
    runners = {
        "engine": lambda _: run_engine(engine, workload),
        "generate": lambda _: run_generate(model, tokenizer, workload),
    }
    for runner in runners.values():
        runner(-1)
    return interleaved(repeats, runners)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny://arithmetic", help="model spec for llmrl.models.load_model")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads, for a smoke run")
    parser.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="the engine's inference.cuda_graphs (on a CPU, `on` runs the paged static decoder eagerly)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model {args.model}: {params / 1e6:.2f}M parameters, {next(model.parameters()).dtype}, "
        f"{next(model.parameters()).device}, torch threads {torch.get_num_threads()}, "
        f"engine fast path: {LocalEngine(model, tokenizer).uses_fast_path}"
    )
    peak = matmul_peak()
    print(f"fp32 matmul peak (1024^3, best over 2 s): {peak / 1e9:.1f} GFLOP/s")
    print(
        f"median of {args.repeats} interleaved repeats; ratio = engine / generate within a repeat "
        f"(q1-q3: the middle half of the repeats' ratios)\n"
    )
    step = decode_step_ms(model, args.repeats)
    print(
        f"one 64-row decode step: engine decoder {step['engine']:.2f} ms; "
        f"model(...) + DynamicCache {step['forward']:.2f} ms\n"
    )

    header = (
        f"{'workload':<10} {'tokens':>7} {'engine tok/s':>13} {'generate tok/s':>15} {'ratio':>7} {'q1-q3':<11} "
        f"{'engine GFLOP/s':>15} {'of peak':>8} {'generate':>9} {'KV engine':>10} "
        f"{'KV generate':>12}"
    )
    print(header)
    for workload in workloads(tokenizer, args.quick):
        runs = compare(model, tokenizer, workload, args.repeats, args.cuda_graphs)
        rates = {name: [r.tokens / r.seconds for r in rs] for name, rs in runs.items()}
        ratios = [e / g for e, g in zip(rates["engine"], rates["generate"], strict=True)]
        # Useful FLOPs of what each produced, over its median time.
        flops = {
            name: statistics.median(
                model_flops(model, r.completions, workload.groups) / r.seconds for r in rs
            )
            for name, rs in runs.items()
        }
        kv = {name: max(r.cache_bytes for r in rs) / 2**20 for name, rs in runs.items()}
        print(
            f"{workload.name:<10} {runs['engine'][0].tokens:>7} {statistics.median(rates['engine']):>13.0f} "
            f"{statistics.median(rates['generate']):>15.0f} {statistics.median(ratios):>6.2f}x "
            f"{quartiles(ratios)} "
            f"{flops['engine'] / 1e9:>15.1f} "
            f"{flops['engine'] / peak:>8.1%} {flops['generate'] / peak:>9.1%} {kv['engine']:>6.1f} MiB "
            f"{kv['generate']:>8.1f} MiB"
        )

    print("\ncost per sample vs group size (one shared ~256-token prompt, 64 new tokens each, eos ignored)")
    print(
        f"{'group':>5} {'prompt':>7} {'engine ms/sample':>17} {'vs n=1':>7} {'generate ms/sample':>19} "
        f"{'vs n=1':>7} {'KV engine':>10} {'KV generate':>12}"
    )
    base: dict[str, float] = {}
    for size in (1, 2, 4, 8, 16):
        group = long_prompt_group(tokenizer, 256, size)
        runs = compare(
            model,
            tokenizer,
            Workload(f"group{size}", [group], ignore_eos=True),
            args.repeats,
            args.cuda_graphs,
        )
        per_sample = {
            name: 1e3 * statistics.median(r.seconds for r in rs) / size for name, rs in runs.items()
        }
        base = base or per_sample
        kv = {name: max(r.cache_bytes for r in rs) / 2**20 for name, rs in runs.items()}
        print(
            f"{size:>5} {len(group.prompt_ids):>7} {per_sample['engine']:>17.1f} "
            f"{per_sample['engine'] / base['engine']:>7.2f} {per_sample['generate']:>19.1f} "
            f"{per_sample['generate'] / base['generate']:>7.2f} {kv['engine']:>6.2f} MiB {kv['generate']:>8.2f} MiB"
        )
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(f"\nprocess peak RSS: {peak_rss:.0f} MiB (model, both runners, allocator caches)")
    if torch.cuda.is_available():
        print(f"CUDA peak allocated: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
