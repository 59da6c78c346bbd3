"""The embedded engine and the trainer on a GPU at real size: throughput, memory plan against peak, FLOP
share.

    python bench/gpu.py [--sizes 0.5b 1.5b] [--prompts 64] [--group-size 8] [--prompt-tokens 128]
                        [--new-tokens 512] [--micro-batch-tokens 16384] [--pack-row-tokens 4096]
                        [--cuda-graphs both|on|off]

For each size, a Qwen2 model with the shapes of Qwen2.5-0.5B or -1.5B and random weights (no hub),
float32 master weights on the GPU, and one GRPO-shaped step: `prompts` prompts of `prompt-tokens`
random ids, `group-size` samples each, exactly `new-tokens` new tokens per sample (eos off, T=1).

- **generation**: `LocalEngine` on a bfloat16 copy against Hugging Face `generate` with a KV cache
  on the same copy (every row in one call, as the engine takes them all at once); completion
  tokens per second, and the model FLOPs of what each produced over its time, as a share of the
  bfloat16 matrix peak measured in the same run (an 8192^3 product). The engine is timed once per
  `--cuda-graphs` value (`both`: its decode steps eager, then captured as CUDA graphs; on a CPU
  "on" runs the same static decode eagerly), each on a fresh engine and its own warm-up, `generate`
  once; a value that fails is reported and the others go on (the exit status is then 1).
- **training**: `PolicyUpdate`, the trainer's step (logprobs, GRPO loss, backward, AdamW) in
  bfloat16 autocast over the float32 masters, on the engine's rollouts with random rewards, with
  and without activation checkpointing, deterministic kernels on as the trainer runs them; tokens
  per second of the step, the model FLOPs (3 x forward, recomputation not counted) as a share of
  the peak, and the memory plan (`llmrl.trainer.memory`, no engine) against the CUDA allocator's
  peak over a step (the engine is freed first).

The first size's first runs include CUDA's start-up; each measurement runs once untimed first.
`--sizes tiny` is a small config that runs on a CPU (a check of the script, not a figure).
`bench/profile_step.py` profiles one generation and one update of the same model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gc
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import transformers
from memory_plans import MODEL_CONFIGS  # bench/, beside this script
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from llmrl.agents.trajectory import Trajectory
from llmrl.config import AlgorithmConfig, TrainingConfig
from llmrl.inference.engine import LocalEngine
from llmrl.inference.interface import run_in_new_loop
from llmrl.models import tiny_model_path
from llmrl.models.loading import enable_activation_checkpointing
from llmrl.models.shape import ModelShape
from llmrl.rollouts.batch import RolloutBatch, prepare_batch
from llmrl.trainer.memory import GB, MemoryPlan, MemorySettings, PeakMemory, plan_memory
from llmrl.trainer.optimization import PolicyUpdate, build_optimizer
from llmrl.trainer.trainer import _deterministic_algorithms
from llmrl.types import GenerationArgs, InferenceRequest, RolloutGroup

SIZES: dict[str, dict[str, int | bool]] = {
    "0.5b": MODEL_CONFIGS["Qwen/Qwen2.5-0.5B-Instruct"],
    "1.5b": MODEL_CONFIGS["Qwen/Qwen2.5-1.5B-Instruct"],
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=4096,
        tie_word_embeddings=True,
    ),
}


@dataclass
class Shape:
    prompts: int
    group_size: int
    prompt_tokens: int
    new_tokens: int

    @property
    def rows(self) -> int:
        return self.prompts * self.group_size


def build_model(size: str, device: str, max_positions: int) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(**SIZES[size], max_position_embeddings=max_positions, rope_theta=1e6)
    with torch.device(device):
        return Qwen2ForCausalLM(config)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: str, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of a matrix product in `dtype` on random data (8192^3 on a GPU), the median of ten."""
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(13):
        synchronize(device)
        began = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - began)
    return 2 * n**3 / statistics.median(times)


def forward_flops(model: torch.nn.Module, lengths: list[tuple[int, int]], shared_prompts: int) -> float:
    """Forward FLOPs of scoring `(prompt, completion)` pairs: weights x tokens (the LM head on the
    completion only) plus causal attention; `shared_prompts` prompts are encoded once per group
    (generation), 0 means every row encodes its own prompt (training)."""
    shape = ModelShape.of(model)
    flops = 0.0
    for prompt, completion in lengths:
        encoded = completion if shared_prompts else prompt + completion
        flops += shape.token_flops * encoded + 2.0 * shape.lm_head * completion
        flops += shape.attention_flops(encoded, prompt + completion - encoded)
    if shared_prompts:
        prompt = lengths[0][0]
        flops += shared_prompts * (shape.token_flops * prompt + shape.attention_flops(prompt))
    return flops


def prompts_of(shape: Shape, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randint(3, vocab, (shape.prompt_tokens,), generator=generator).tolist()
        for _ in range(shape.prompts)
    ]


def run_engine(
    engine: LocalEngine, prompts: list[list[int]], shape: Shape, new_tokens: int
) -> tuple[float, list]:
    # The prompt text is one token appended to the random ids (the engine needs a prompt).
    args = GenerationArgs(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0)
    requests = [
        InferenceRequest(prompt=" 1", prompt_token_ids=ids, n=shape.group_size, generation_args=args)
        for ids in prompts
    ]

    async def generate_all():
        return await asyncio.gather(*(engine.agenerate(r) for r in requests))

    device = next(engine.model.parameters()).device.type
    synchronize(device)
    began = time.perf_counter()
    results = run_in_new_loop(generate_all())
    synchronize(device)
    return time.perf_counter() - began, results


def run_generate(model, full_prompts: list[list[int]], shape: Shape, new_tokens: int) -> float:
    rows = torch.tensor([ids for ids in full_prompts for _ in range(shape.group_size)], device=model.device)
    synchronize(model.device.type)
    began = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            rows,
            attention_mask=torch.ones_like(rows),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    synchronize(model.device.type)
    assert out.shape[1] == rows.shape[1] + new_tokens
    return time.perf_counter() - began


def make_engine(served: torch.nn.Module, tokenizer, shape: Shape, cuda_graphs: str) -> LocalEngine:
    """The engine as the bench runs it: every row at once, eos off; `cuda_graphs` "on", "off" or "auto"."""
    context = shape.prompt_tokens + 8 + shape.new_tokens
    return LocalEngine(
        served,
        tokenizer,
        max_concurrent=shape.rows,
        seed=0,
        eos_token_ids=(),
        max_batch_tokens=shape.prompts * context + shape.rows * shape.new_tokens,
        cuda_graphs=cuda_graphs,
    )


def generation(
    master: Qwen2ForCausalLM, tokenizer, shape: Shape, peak: float, reference: bool, cuda_graphs: str = "off"
) -> tuple[dict[str, float], list]:
    served = copy.deepcopy(master).to(torch.bfloat16).eval()
    prompts = prompts_of(shape, master.config.vocab_size)
    engine = make_engine(served, tokenizer, shape, cuda_graphs)
    run_engine(engine, prompts, shape, 8)
    engine_s, results = run_engine(engine, prompts, shape, shape.new_tokens)
    generate_s = float("nan")
    if reference:
        full_prompts = [responses[0].prompt_token_ids for responses in results]
        run_generate(served, full_prompts, shape, 8)
        generate_s = run_generate(served, full_prompts, shape, shape.new_tokens)
    lengths = [(len(r.prompt_token_ids), len(r.token_ids)) for responses in results for r in responses]
    tokens = sum(c for _, c in lengths)
    flops = forward_flops(served, lengths, shared_prompts=shape.prompts)
    del engine, served
    figures = {
        "engine_tok_s": tokens / engine_s,
        "generate_tok_s": tokens / generate_s,
        "engine_mfu": flops / engine_s / peak,
        "generate_mfu": flops / generate_s / peak,
    }
    return figures, results


def groups_of(results: list) -> list[RolloutGroup]:
    """The engine's samples as GRPO groups with random 0/1 rewards (about half right, so most groups train)."""
    rewards = torch.Generator().manual_seed(2)
    groups = []
    for g, responses in enumerate(results):
        rollouts = []
        for response in responses:
            trajectory = Trajectory(GenerationArgs(temperature=1.0))  # as `run_engine` sampled them
            trajectory.add_context(response.prompt_token_ids, "")
            trajectory.add_completion(response)
            reward = float(torch.rand((), generator=rewards) < 0.5)
            rollouts.append(trajectory.rollout("bench", f"p{g}", reward))
        groups.append(RolloutGroup(group_id=f"g{g}", rollouts=rollouts))
    return groups


def training_config(args: argparse.Namespace, checkpointing: bool) -> TrainingConfig:
    """The update's settings from the command line (`micro_batch_tokens`, `pack_row_tokens`, `share_prefixes`)."""
    return TrainingConfig(
        lr=1e-6,
        micro_batch_tokens=args.micro_batch_tokens,
        pack_row_tokens=args.pack_row_tokens,
        share_prefixes=args.share_prefixes,
        activation_checkpointing=checkpointing,
    )


def update_plan(policy: torch.nn.Module, config: TrainingConfig, device: str) -> MemoryPlan:
    """The memory plan of the update alone (no engine), bfloat16 over float32 masters."""
    settings = MemorySettings(
        master_dtype=torch.float32,
        compute_dtype=torch.bfloat16,
        world_size=1,
        micro_batch_tokens=config.micro_batch_tokens,
        row_tokens=config.pack_row_tokens,
        activation_checkpointing=config.activation_checkpointing,
        reference_model=False,
        engine_tokens=None,
    )
    return plan_memory(policy, settings, device)


def make_update(
    policy: torch.nn.Module,
    groups: list[RolloutGroup],
    shape: Shape,
    config: TrainingConfig,
    logits_chunk_tokens: int | None = None,
) -> tuple[PolicyUpdate, RolloutBatch]:
    """The trainer's step over `policy` (AdamW, bfloat16 autocast) and the GRPO batch of `groups`, its
    LM head in chunks of `logits_chunk_tokens` (the memory plan's, as the trainer takes them)."""
    algorithm = AlgorithmConfig()
    optimizer, _ = build_optimizer(policy, config)
    update = PolicyUpdate(
        policy,
        optimizer,
        algorithm=algorithm,
        training=config,
        generation_args=GenerationArgs(),
        max_tokens=shape.new_tokens,
        pad_token_id=0,
        compute_dtype=torch.bfloat16,
        logits_chunk_tokens=logits_chunk_tokens,
    )
    batch, _ = prepare_batch(
        groups, group_size=shape.group_size, algorithm=algorithm, max_tokens=shape.new_tokens
    )
    return update, batch


def training(
    master: Qwen2ForCausalLM,
    groups: list[RolloutGroup],
    shape: Shape,
    args: argparse.Namespace,
    checkpointing: bool,
    peak: float,
) -> dict[str, float]:
    device = master.device.type
    policy = copy.deepcopy(master).train()
    if checkpointing:
        enable_activation_checkpointing(policy)
    config = training_config(args, checkpointing)
    plan = update_plan(policy, config, device)
    update, batch = make_update(policy, groups, shape, config, plan.logits_chunk_tokens)
    trained = [r for r, a in zip(batch.rollouts, batch.advantages.tolist(), strict=True) if a != 0]
    tokens = sum(len(r.tokens) for r in trained)
    lengths = [(len(r.trajectory[0]), len(r.trajectory[1])) for r in trained]
    memory = PeakMemory(device)
    times, peaks, metrics = [], [], {}
    with _deterministic_algorithms() if args.deterministic else contextlib.nullcontext():
        for step in range(args.steps):
            synchronize(device)
            memory.take()
            began = time.perf_counter()
            metrics = update(batch, torch.Generator().manual_seed(step))
            synchronize(device)
            times.append(time.perf_counter() - began)
            peaks.append(memory.take())
    seconds = statistics.median(times[1:])
    flops = 3 * forward_flops(policy, lengths, shared_prompts=0)
    del update, policy
    return {
        "tok_s": tokens / seconds,
        "seconds": seconds,
        "tokens": tokens,
        "mfu": flops / seconds / peak,
        "plan_gb": plan.total() / GB,
        "peak_gb": max(peaks[1:]),
        "first_peak_gb": peaks[0],
        "mismatch_kl": metrics.get("mismatch_kl", float("nan")),
    }


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["0.5b", "1.5b"])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--pack-row-tokens", type=int, default=4096)
    parser.add_argument("--share-prefixes", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="deterministic kernels, as the trainer runs by default (training.deterministic)",
    )
    parser.add_argument("--checkpointing", choices=["both", "off", "on"], default="both")
    parser.add_argument(
        "--cuda-graphs",
        choices=["both", "off", "on"],
        default="both",
        help="the engine's decode steps eager (off), captured as CUDA graphs (on), or each in turn",
    )
    parser.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time Hugging Face generate beside the engine",
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="training steps timed per mode (the first untimed)"
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = Shape(args.prompts, args.group_size, args.prompt_tokens, args.new_tokens)
    # The shipped tokenizer renders the one-token prompt text; ids past its vocabulary decode to nothing.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path("arithmetic"))
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    peak = matmul_peak(device)
    print(
        f"{name}; torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}; "
        f"bfloat16 matrix peak {peak / 1e12:.0f} TFLOP/s (measured)"
    )
    print(
        f"batch: {shape.prompts} prompts x {shape.group_size} samples, {shape.prompt_tokens} prompt + "
        f"{shape.new_tokens} new tokens; micro_batch_tokens {args.micro_batch_tokens}, pack_row_tokens "
        f"{args.pack_row_tokens}",
        flush=True,
    )
    graph_modes = {"both": ("off", "on"), "off": ("off",), "on": ("on",)}[args.cuda_graphs]
    failed = False
    rows = []
    for size in args.sizes:
        master = build_model(size, device, max_positions=shape.prompt_tokens + shape.new_tokens + 64)
        parameters = sum(p.numel() for p in master.parameters())
        gens: dict[str, dict[str, float]] = {}  # the engine's figures by graph mode
        generate_tok_s = math.nan  # Hugging Face `generate`, timed beside the first engine that runs
        results = None
        for mode in graph_modes:
            reference = args.reference and math.isnan(generate_tok_s)
            try:
                gen, mode_results = generation(master, tokenizer, shape, peak, reference, cuda_graphs=mode)
            except Exception:  # reported; the other modes still run and the exit status says so
                failed = True
                print(f"{size}: engine (graphs {mode}) failed:", flush=True)
                traceback.print_exc()
                gen, mode_results = {"engine_tok_s": math.nan, "engine_mfu": math.nan}, None
            free(device)
            gens[mode] = gen
            if mode_results is None:
                continue
            results = results or mode_results
            line = (
                f"{size}: {parameters / 1e9:.2f}B parameters; engine (graphs {mode}) "
                f"{gen['engine_tok_s']:.0f} tok/s ({gen['engine_mfu']:.1%} of peak)"
            )
            if reference:
                generate_tok_s = gen["generate_tok_s"]
                line += f", generate {generate_tok_s:.0f} tok/s ({gen['generate_mfu']:.1%})"
            print(line, flush=True)
        if results is None:
            del master
            free(device)
            continue
        groups = groups_of(results)
        for checkpointing in {"both": (False, True), "off": (False,), "on": (True,)}[args.checkpointing]:
            train = training(master, groups, shape, args, checkpointing, peak)
            free(device)
            error = train["plan_gb"] / train["peak_gb"] - 1
            label = "checkpointed" if checkpointing else "kept"
            print(
                f"{size} {label}: {train['tokens']} tokens in {train['seconds']:.2f} s, {train['tok_s']:.0f} tok/s "
                f"({train['mfu']:.1%} of peak); plan {train['plan_gb']:.2f} GB, peak {train['peak_gb']:.2f} GB "
                f"(first step {train['first_peak_gb']:.2f}), plan error {error:+.1%}; mismatch KL "
                f"{train['mismatch_kl']:.1e}",
                flush=True,
            )
            rows.append((size, parameters, gens, generate_tok_s, label, train, error))
        del master, results, groups
        free(device)

    # One row per size and activation mode; the engine's columns once per graph mode.
    engine_columns = [
        column
        for mode in graph_modes
        for column in (f"engine tok/s (graphs {mode})", f"engine / generate (graphs {mode})")
    ] + [f"engine FLOP share (graphs {mode})" for mode in graph_modes]
    columns = ["model", "parameters", *engine_columns, "generate tok/s", "activations", "train tok/s"]
    columns += ["train FLOP share", "plan GB", "peak GB", "plan error"]
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for size, parameters, gens, generate_tok_s, label, train, error in rows:
        cells = [f"Qwen2.5-{size.upper()} shape", f"{parameters / 1e9:.2f}B"]
        for mode in graph_modes:
            cells += [
                f"{gens[mode]['engine_tok_s']:.0f}",
                f"{gens[mode]['engine_tok_s'] / generate_tok_s:.2f}x",
            ]
        cells += [f"{gens[mode]['engine_mfu']:.1%}" for mode in graph_modes]
        cells += [f"{generate_tok_s:.0f}", label, f"{train['tok_s']:.0f}", f"{train['mfu']:.1%}"]
        cells += [f"{train['plan_gb']:.2f}", f"{train['peak_gb']:.2f}", f"{error:+.1%}"]
        print("| " + " | ".join(cells) + " |")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
