"""LoRA against full fine-tuning on a ~100M-parameter model: what a weight sync moves and how long it
takes on each inference backend, and the trainer's peak memory in a training step.

    OMP_NUM_THREADS=1 python bench/lora.py [--sync-repeats 5] [--rows 4] [--row-tokens 256]

The model is bench/serving.py's random Qwen2 (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2048, 32k vocabulary, tied embeddings), in float32 as the trainer loads it by default.
LoRA: rank 16, alpha 32, every linear layer (``all-linear``), built by the trainer's `Adapters`.

1. Sync: what the trainer sends after a step (full fine-tuning: the float32 state dict without the
   tied LM head; LoRA: `Adapters.weights()`) to the embedded engine (`LocalEngine` in this process,
   which merges an adapter onto its copy of the base weights) and to llmrl's server
   (``llmrl serve-inference`` on loopback, one per mode; the adapter or the weights as a file in a
   shared ``--weights-dir`` and streamed over HTTP). A first sync (not timed) brings each receiver
   to its steady state (an engine keeps its base copy at the first adapter); then the median and
   best of `--sync-repeats` syncs, each a new version.
2. Memory: in a fresh process per mode, one training step as the trainer runs it on one process:
   `token_logprobs` of `rows` packed rows of `row-tokens` random tokens, a loss, the backward pass
   and AdamW's step (`build_optimizer`: the trainable parameters only). The peak is the resident
   set's high-water mark of the whole process during the step (weights, gradients, AdamW's moments,
   activations and their freed temporaries that the allocator keeps, Python and torch); beside it,
   the bytes of the tensors a training step keeps: weights, gradients and AdamW's moments.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from serving import inference_server, random_100m_model  # bench/serving.py, this script's sibling

from llmrl.algorithms.logprobs import token_logprobs
from llmrl.algorithms.packing import build_batch
from llmrl.config import LoraConfig
from llmrl.inference import InferenceInterface
from llmrl.inference.engine import LocalEngine
from llmrl.inference.openai import OpenAIInterface
from llmrl.models import load_model
from llmrl.trainer.distributed import tied_duplicates
from llmrl.trainer.lora import Adapters
from llmrl.trainer.memory import GB, PeakMemory
from llmrl.trainer.weight_sync import WeightsSource, weights_source

LORA = LoraConfig(rank=16, alpha=32, target_modules="all-linear")
MODES = ("full", "lora")


def trainer_policy(spec: str, mode: str) -> tuple[torch.nn.Module, Adapters | None]:
    """The model the trainer trains in `mode`: the whole model, or LoRA adapters over it."""
    torch.manual_seed(0)
    model, _ = load_model(spec)
    if mode == "full":
        return model, None
    adapters = Adapters(model, LORA)
    return adapters.model, adapters


def sync_source(spec: str, mode: str) -> tuple[WeightsSource, int]:
    """What the trainer syncs in one process, and the bytes of one sync."""
    policy, adapters = trainer_policy(spec, mode)
    source = weights_source(
        policy,
        adapters=adapters,
        distributed=None,
        tied_names=tied_duplicates(policy),
        bucket_bytes=1 << 30,
        compute_dtype=torch.float32,
    )
    payload = source.payload(None)
    payload.drain()
    return source, payload.nbytes


def timed_syncs(receiver: InferenceInterface, source: WeightsSource, repeats: int) -> list[float]:
    """Sync `source`'s weights to `receiver` once untimed, then `repeats` times timed (seconds each)."""
    transport = receiver.weight_transport(source.kind)
    transport.send(source.payload(transport), 1, reset=True)
    times = []
    for version in range(2, repeats + 2):
        started = time.perf_counter()
        transport.send(source.payload(transport), version, reset=True)
        times.append(time.perf_counter() - started)
    return times


def bench_sync(spec: str, scratch: Path, repeats: int) -> list[tuple[str, str, int, list[float]]]:
    """(mode, receiver, bytes, seconds of each timed sync) for both modes and every receiver."""
    rows = []
    for mode in MODES:
        source, nbytes = sync_source(spec, mode)
        served, tokenizer = load_model(spec)
        engine = LocalEngine(served, tokenizer, owns_model=True)
        rows.append((mode, "embedded engine", nbytes, timed_syncs(engine, source, repeats)))
        del engine, served
        weights_dir = scratch / f"weights-{mode}"
        weights_dir.mkdir()
        with inference_server(spec, weights_dir) as base_url:
            for how, folder in (("file", weights_dir), ("stream", None)):
                client = OpenAIInterface(base_url, weights_dir=folder)
                rows.append((mode, f"llmrl server ({how})", nbytes, timed_syncs(client, source, repeats)))
    return rows


def measure_step(spec: str, mode: str, rows: int, row_tokens: int) -> dict[str, float]:
    """One training step in this process (a child: nothing else ran here); its peak and seconds."""
    from llmrl.config import TrainingConfig
    from llmrl.trainer.optimization import build_optimizer

    policy, _ = trainer_policy(spec, mode)
    policy.train()
    optimizer, _ = build_optimizer(policy, TrainingConfig())
    vocab = policy.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(1, vocab, (row_tokens,), generator=generator).tolist() for _ in range(rows)]
    batch = build_batch(sequences, [[i] for i in range(rows)])
    peak = PeakMemory("cpu")
    started = time.perf_counter()
    logprobs, _ = token_logprobs(policy, batch)
    loss = -logprobs.sum() / batch.loss_mask.sum()
    loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - started
    moments = [value for state in optimizer.state.values() for value in state.values()]
    held = [*policy.parameters(), *(p.grad for p in policy.parameters() if p.grad is not None), *moments]
    return {
        "peak_gb": peak.take(),
        "state_gb": sum(t.numel() * t.element_size() for t in held) / GB,
        "seconds": seconds,
        "parameters_m": sum(p.numel() for p in policy.parameters()) / 1e6,
        "trainable_m": sum(p.numel() for p in policy.parameters() if p.requires_grad) / 1e6,
    }


def bench_memory(spec: str, rows: int, row_tokens: int) -> dict[str, dict[str, float]]:
    results = {}
    for mode in MODES:
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--step",
                mode,
                spec,
                "--rows",
                str(rows),
                "--row-tokens",
                str(row_tokens),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        results[mode] = json.loads(child.stdout.strip().splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sync-repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--row-tokens", type=int, default=256)
    parser.add_argument(
        "--step", nargs=2, metavar=("MODE", "SPEC"), help=argparse.SUPPRESS
    )  # a child process
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()
    if args.step:
        mode, spec = args.step
        print(json.dumps(measure_step(spec, mode, args.rows, args.row_tokens)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        spec = str(random_100m_model(scratch / "model-100m"))
        memory = bench_memory(spec, args.rows, args.row_tokens)
        syncs = bench_sync(spec, scratch, args.sync_repeats)
    full, lora = memory["full"], memory["lora"]
    print(
        f"model: {full['parameters_m']:.1f}M parameters, float32; LoRA rank {LORA.rank}, alpha {LORA.alpha:g}, "
        f"all-linear: {lora['trainable_m']:.2f}M trainable ({100 * lora['trainable_m'] / lora['parameters_m']:.2f}%)"
    )
    print(f"\nweight sync (median and best of {args.sync_repeats}):")
    print(f"{'mode':<6}{'receiver':<24}{'bytes':>14}{'median s':>11}{'best s':>9}")
    for mode, receiver, nbytes, times in syncs:
        print(
            f"{mode:<6}{receiver:<24}{nbytes / 2**20:>10.1f} MiB{statistics.median(times):>11.3f}{min(times):>9.3f}"
        )
    print(f"\ntraining step ({args.rows} x {args.row_tokens} tokens, one process, fresh per mode):")
    print(f"{'mode':<6}{'peak resident set':>20}{'weights, grads, AdamW':>24}{'step s':>9}")
    for mode, result in memory.items():
        print(
            f"{mode:<6}{result['peak_gb']:>17.2f} GB{result['state_gb']:>21.2f} GB{result['seconds']:>9.2f}"
        )


if __name__ == "__main__":
    main()
