"""Per-rank peak memory of a two-process training run on CPU, against one full fp32 copy of the model.

    python bench/distributed_memory.py [--layers 12] [--steps 2] [--llmrl PATH]

Builds a random Qwen2-style model (hidden 768, `--layers` decoder layers: ~105M parameters with 12;
the tiny model's tokenizer) into a temporary folder, trains it for `--steps` steps with
``torchrun --nproc-per-node 2 -m llmrl train`` (the arithmetic demo, 2 prompts x 2 samples of
8 tokens, the embedded engine on rank 0) and prints for each rank its peak resident memory:

- once the trainer is built (models loaded and sharded, the engine built, the first weight sync);
- up to the final checkpoint (loading, every step's training and weight sync), and overall (the
  checkpoint's Hugging Face folder is written from weights gathered whole on rank 0);
- against the memory plan the trainer prints at start (`llmrl.trainer.memory`, its total for that
  rank): the process before the model loads, its half of the weights, gradients and AdamW's two
  moments, the gathered blocks, the largest micro-batch's activations and, on rank 0, the
  engine's copy and KV cache.

`--llmrl PATH` runs the llmrl package found in PATH instead of this checkout's (e.g. an earlier
commit exported with ``git archive COMMIT | tar -x -C PATH``), for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 1 << 20
SETTINGS = [
    "training.prompts_per_step=2",
    "training.group_size=2",
    "inference.generation.max_tokens=8",
    "inference.max_concurrent=4",
    "inference.max_batch_tokens=256",
    "training.micro_batch_tokens=128",
    "evaluation.at_start=false",
    "evaluation.every=0",
    "evaluation.at_end=false",
    "checkpoint.every=0",
    "logging.progress=off",
    "logging.tensorboard=false",
    "logging.trace=false",
    # A random model earns no reward, and all-zero advantages skip the update: a small entropy bonus
    # makes every step run its backward pass and AdamW step.
    "algorithm.entropy_coef=0.001",
]


def status_mb(field: str) -> float:
    """A memory figure of this process from /proc (VmRSS: now; VmHWM: the peak so far), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(result_file: Path, train_args: list[str]) -> None:
    """One torchrun process: `llmrl train`, with its memory figures written to `result_file`."""
    from llmrl.cli import main
    from llmrl.trainer import Trainer

    figures = {"rank": int(os.environ["RANK"]), "after_imports_mb": status_mb("VmRSS")}
    build, save = Trainer._build, Trainer._save

    def build_noting_the_peak(self: Trainer, *args: object) -> None:
        build(self, *args)
        figures["peak_built_mb"] = status_mb("VmHWM")
        plan = getattr(self, "memory_plan", None)  # absent in llmrl before the memory plan (--llmrl)
        figures["plan_mb"] = plan.total(rank0=self.is_main) / MB if plan else float("nan")

    def save_noting_the_peak(self: Trainer) -> None:
        figures.setdefault("peak_before_checkpoint_mb", status_mb("VmHWM"))
        save(self)

    Trainer._build, Trainer._save = build_noting_the_peak, save_noting_the_peak
    code = main(["train", *train_args])
    figures["peak_mb"] = status_mb("VmHWM")
    result_file.with_suffix(f".{figures['rank']}.json").write_text(json.dumps(figures))
    sys.exit(code)


def build_model(folder: Path, layers: int) -> int:
    """A random Qwen2-style model with the tiny model's tokenizer in `folder`; returns its parameter count."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from llmrl.models.tiny import tiny_model_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path("arithmetic"))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--bucket-mb", type=int, help="inference.weight_sync_bucket_mb (default: the config's)"
    )
    parser.add_argument(
        "--llmrl", type=Path, help="folder holding the llmrl package to run (default: this checkout)"
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker is not None:
        worker(args.worker, rest)
        return
    package_root = (args.llmrl or Path(__file__).resolve().parent.parent).resolve()
    with tempfile.TemporaryDirectory(prefix="llmrl-distmem-") as temp:
        root = Path(temp)
        parameters = build_model(root / "model", args.layers)
        full_mb = parameters * 4 / MB
        settings = [
            *SETTINGS,
            f"training.steps={args.steps}",
            f"model.spec={root / 'model'}",
            f"run_dir={root / 'run'}",
        ]
        if args.bucket_mb is not None:
            settings.append(f"inference.weight_sync_bucket_mb={args.bucket_mb}")
        train_args = [a for s in settings for a in ("--set", s)]
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(Path(__file__).resolve()),
            "--worker",
            str(root / "figures"),
            *train_args,
        ]
        environment = os.environ | {"PYTHONPATH": str(package_root)}
        subprocess.run(command, check=True, cwd=root, env=environment)
        ranks = [json.loads((root / f"figures.{rank}.json").read_text()) for rank in range(2)]
    print(
        f"\nllmrl from {package_root}; model: {parameters / 1e6:.1f}M parameters, one fp32 copy {full_mb:.0f} MB"
    )
    print(
        f"{'rank':>4} {'imports':>8} {'built':>12} {'to checkpoint':>14} {'overall':>12} {'plan':>6}"
        "   (MB; peaks, in full copies)"
    )
    for figures in ranks:
        peaks = [figures[k] for k in ("peak_built_mb", "peak_before_checkpoint_mb", "peak_mb")]
        shown = " ".join(f"{mb:>7.0f} ({mb / full_mb:.1f})" for mb in peaks)
        print(f"{figures['rank']:>4} {figures['after_imports_mb']:>8.0f} {shown} {figures['plan_mb']:>6.0f}")


if __name__ == "__main__":
    main()
