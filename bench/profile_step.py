"""One decode-heavy engine generation and one training update of `bench/gpu.py`'s model under
`torch.profiler`: a Chrome trace and the ops that took the most time.

    python bench/profile_step.py [--size 0.5b] [--device cuda|cpu] [--prompts 16] [--group-size 4]
                                 [--prompt-tokens 64] [--new-tokens 64] [--cuda-graphs on|off|auto]
                                 [--no-update] [--out gpu-checks/trace.json]

The model is `bench/gpu.py`'s (`build_model`: the shapes of Qwen2.5-`size`, random weights, float32
masters; the engine serves a bfloat16 copy, eos off, T=1, exactly `new-tokens` new tokens per
sample), the update its `PolicyUpdate` (GRPO loss, backward, AdamW in bfloat16 autocast, no
activation checkpointing, deterministic kernels as the trainer runs them) on the engine's samples
with random rewards. Both run once untimed first (start-up, allocator, optimizer state), then once
under the profiler (CPU and CUDA activities on a GPU, CPU only on a CPU). Printed: the wall time of
each profiled part (the trace marks them `generation` and `update`) and the 15 ops with the most self time on the device (self CPU time on a CPU).
The trace opens in https://ui.perfetto.dev or chrome://tracing.

`--cuda-graphs` is passed to `LocalEngine` when given (default: the engine's own default); with
graphs on, decode steps show in the trace as graph launches, not their kernels. The default size is
0.5b on a GPU and `tiny` on a CPU (`--device cpu`: a check of the script, seconds).
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
from pathlib import Path

import torch
from gpu import (  # bench/, beside this script
    SIZES,
    LocalEngine,
    Shape,
    groups_of,
    make_update,
    prompts_of,
    run_engine,
    synchronize,
    training_config,
    update_plan,
)
from gpu import build_model as build_gpu_model
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoTokenizer

from llmrl.models import tiny_model_path
from llmrl.trainer.trainer import _deterministic_algorithms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size", choices=list(SIZES), default=None, help="default: 0.5b on cuda, tiny on cpu"
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cuda-graphs", choices=["on", "off", "auto"], default=None)
    parser.add_argument(
        "--update", action=argparse.BooleanOptionalAction, default=True, help="profile a training update too"
    )
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--pack-row-tokens", type=int, default=4096)
    parser.add_argument("--share-prefixes", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--rows", type=int, default=15, help="ops in the printed table")
    parser.add_argument("--out", type=Path, default=Path("gpu-checks/trace.json"))
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda without CUDA; pass --device cpu")
    size = args.size or ("0.5b" if device == "cuda" else "tiny")
    shape = Shape(args.prompts, args.group_size, args.prompt_tokens, args.new_tokens)
    began = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path("arithmetic"))
    master = build_gpu_model(size, device, max_positions=shape.prompt_tokens + shape.new_tokens + 64)
    served = copy.deepcopy(master).to(torch.bfloat16).eval()
    context = shape.prompt_tokens + 8 + shape.new_tokens
    engine_args = dict(
        max_concurrent=shape.rows,
        seed=0,
        eos_token_ids=(),
        max_batch_tokens=shape.prompts * context + shape.rows * shape.new_tokens,
    )
    if args.cuda_graphs is not None:
        engine_args["cuda_graphs"] = args.cuda_graphs
    engine = LocalEngine(served, tokenizer, **engine_args)
    prompts = prompts_of(shape, master.config.vocab_size)
    run_engine(engine, prompts, shape, shape.new_tokens)  # warm-up: the same decode lengths (graph buckets)

    update = batch = None
    if args.update:
        _, results = run_engine(engine, prompts, shape, 8)
        policy = copy.deepcopy(master).train()
        config = training_config(args, False)
        chunk = update_plan(policy, config, device).logits_chunk_tokens  # the trainer's LM-head chunks
        update, batch = make_update(policy, groups_of(results), shape, config, chunk)
        with _deterministic_algorithms():
            update(batch, torch.Generator().manual_seed(0))  # warm-up: optimizer state, allocator
    synchronize(device)
    print(
        f"{size} on {device}, torch {torch.__version__}: ready in {time.perf_counter() - began:.1f} s",
        flush=True,
    )

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    timings = {}
    with profile(activities=activities) as profiler:
        with record_function("generation"):
            timings["generation"], results = run_engine(engine, prompts, shape, shape.new_tokens)
        if update is not None:
            with record_function("update"), _deterministic_algorithms():
                synchronize(device)
                step_began = time.perf_counter()
                update(batch, torch.Generator().manual_seed(1))
                synchronize(device)
                timings["update"] = time.perf_counter() - step_began
    tokens = sum(len(r.token_ids) for responses in results for r in responses)
    print(
        f"generation: {shape.prompts} prompts x {shape.group_size} samples, {shape.prompt_tokens} prompt + "
        f"{shape.new_tokens} new tokens: {timings['generation']:.2f} s, {tokens / timings['generation']:.0f} tok/s "
        f"(profiled)"
    )
    if "update" in timings:
        print(f"update: {timings['update']:.2f} s/step (profiled)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(args.out))
    print(f"trace: {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")
    sort_by = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    print(f"\ntop {args.rows} ops by {sort_by}:")
    # Without the two `record_function` ranges, whose totals are printed above.
    ops = EventList(
        [e for e in profiler.key_averages() if e.key not in timings],
        use_device="cuda" if device == "cuda" else None,
    )
    print(ops.table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=60))
    del engine, update, served, master
    gc.collect()


if __name__ == "__main__":
    main()
