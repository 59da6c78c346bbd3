"""Peak memory and time of one training micro-batch with and without activation checkpointing.

    python bench/activation_checkpointing.py [--layers 10] [--hidden 512] [--rows 4] [--row-tokens 512]

Builds a random Qwen2-style model (about 50M parameters with the defaults: 10 layers of width 512,
a 16k vocabulary, untied LM head), packs `rows` rows of `row-tokens` random tokens, and runs what
the trainer runs per micro-batch (`token_logprobs`, a loss, the backward pass) in float32, once
with every activation kept and once with `training.activation_checkpointing`. Each mode runs in a
fresh process so the peaks do not mix; on CPU the peak is the resident set's high-water mark during
the micro-batch, minus the resident set before it (the model, its gradients, Python and torch are
the same in both). The parent checks that the two losses and gradient norms agree (within 1e-6).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from llmrl.algorithms.logprobs import token_logprobs
from llmrl.algorithms.packing import build_batch
from llmrl.models.loading import enable_activation_checkpointing
from llmrl.trainer.memory import GB, PeakMemory, resident_bytes


def build(args: argparse.Namespace) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.row_tokens,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).train()


def measure(args: argparse.Namespace, checkpointing: bool) -> dict[str, float]:
    """One micro-batch forward and backward in this process; its memory above the resident baseline."""
    model = build(args)
    if checkpointing:
        enable_activation_checkpointing(model)
    generator = torch.Generator().manual_seed(1)
    sequences = [
        torch.randint(1, args.vocab, (args.row_tokens,), generator=generator).tolist()
        for _ in range(args.rows)
    ]
    batch = build_batch(sequences, [[i] for i in range(args.rows)])
    for parameter in model.parameters():  # gradients exist before the baseline, as in training
        parameter.grad = torch.zeros_like(parameter)
    peak = PeakMemory("cpu")
    baseline = resident_bytes() / GB
    peak.take()
    started = time.perf_counter()
    logprobs, _ = token_logprobs(model, batch)
    loss = -logprobs.sum() / batch.loss_mask.sum()
    loss.backward()
    seconds = time.perf_counter() - started
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    return {
        "above_baseline_gb": peak.take() - baseline,
        "seconds": seconds,
        "loss": loss.item(),
        "grad_norm": norm.item(),
        "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--row-tokens", type=int, default=512)
    parser.add_argument("--mode", choices=["kept", "checkpointed"], help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args, args.mode == "checkpointed")))
        return
    results = {}
    for mode in ("kept", "checkpointed"):
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--mode", mode],
            check=True,
            capture_output=True,
            text=True,
        )
        results[mode] = json.loads(child.stdout.strip().splitlines()[-1])
    kept, checkpointed = results["kept"], results["checkpointed"]
    print(
        f"model: {kept['parameters_m']:.1f}M parameters, {args.layers} layers; micro-batch {args.rows} x "
        f"{args.row_tokens} tokens, float32, CPU"
    )
    print(f"{'mode':<14}{'memory above baseline':>24}{'seconds':>10}")
    for mode, result in results.items():
        print(f"{mode:<14}{result['above_baseline_gb']:>21.3f} GB{result['seconds']:>10.2f}")
    print(
        f"ratio (checkpointed / kept): memory {checkpointed['above_baseline_gb'] / kept['above_baseline_gb']:.2f}, "
        f"time {checkpointed['seconds'] / kept['seconds']:.2f}"
    )
    loss_gap = abs(kept["loss"] - checkpointed["loss"])
    norm_gap = abs(kept["grad_norm"] - checkpointed["grad_norm"]) / kept["grad_norm"]
    print(f"loss difference {loss_gap:.1e}, gradient norm relative difference {norm_gap:.1e}")
    if loss_gap > 1e-6 or norm_gap > 1e-6:
        raise SystemExit("activation checkpointing changed the loss or the gradients")


if __name__ == "__main__":
    main()
