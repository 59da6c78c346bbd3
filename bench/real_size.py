"""`llmrl train` itself at a real model's shape: seconds per step and where they go, FLOP shares, memory.

    python bench/real_size.py [--shape tiny|0.5b|1.5b|7b] [--steps 3] [--prompts 64] [--group-size 8]
                              [--prompt-tokens 64] [--new-tokens 256] [--set KEY=VALUE ...]

A Qwen2 with the body of Qwen2.5-0.5B, -1.5B or -7B (`tiny`: a small one for a CPU), random weights
(seeded, no hub) and the shipped tiny model's 1,024-token tokenizer, is written to a scratch folder.
`llmrl train` then runs on it, as a user would start it, with the defaults a user gets plus: a
dataset agent over `--prompts x steps` prompts of `--prompt-tokens` digits, sent as plain text, with a
graded reward (the share of digits in the completion, so that almost every group has a spread and
every step updates), `--group-size` samples of exactly `--new-tokens` tokens each (eos ignored,
T=1), bfloat16 compute over float32 master weights and activation checkpointing on a GPU (float32 on
a CPU), no evaluation and no checkpoints. `--set` passes further overrides to `llmrl train`.

Per step it prints, from the run's metrics.jsonl: the seconds of the step, of its rollouts (the wait
for them), of the update and of the weight sync; completion tokens per second over the step; the
model FLOPs of generation over `time/generate_s` and of the update over `time/train_s` as shares of
the matrix-product peak measured here first (bfloat16 8192^3 on a GPU, float32 1024^3 on a CPU); the
measured memory peak against the plan; and the mismatch KL between the engine's and the trainer's
logprobs. Model FLOPs: weights x tokens plus causal attention (`bench/gpu.py`'s `forward_flops`):
generation encodes each prompt once and each completion token once; the update is three forwards
(forward and backward) plus the no-grad pass of the old logprobs when there is one, with
recomputation under activation checkpointing not counted. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from gpu import SIZES, forward_flops, matmul_peak  # bench/, beside this script
from memory_plans import MODEL_CONFIGS
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from llmrl.config import load_config
from llmrl.models import tiny_model_path
from llmrl.telemetry import read_metrics

SHAPES = SIZES | {"7b": MODEL_CONFIGS["Qwen/Qwen2.5-7B-Instruct"]}

REWARD = '''
def digit_share(completions, **kwargs):
    """A graded reward: the share of digits in the completion."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
'''


def write_model(shape: str, folder: Path, device: str, dtype: torch.dtype) -> Qwen2ForCausalLM:
    """A random Qwen2 of `shape` with the tiny model's tokenizer, saved in `dtype`; returned on meta."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path("arithmetic"))
    config = Qwen2Config(
        **(SHAPES[shape] | {"vocab_size": len(tokenizer)}),
        max_position_embeddings=4096,
        rope_theta=1e6,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


def write_data(folder: Path, count: int, digits: int) -> Path:
    rng = random.Random(0)
    path = folder / "prompts.jsonl"
    with path.open("w") as out:
        for i in range(count):
            text = "".join(rng.choice("0123456789") for _ in range(digits))
            out.write(json.dumps({"question": text, "id": i}) + "\n")
    return path


def prompt_tokens(model_folder: Path, data: Path) -> int:
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    lengths = [len(tokenizer(json.loads(line)["question"]).input_ids) for line in data.open()]
    return round(sum(lengths) / len(lengths))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64, help="digits per prompt")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    peak = matmul_peak(device, getattr(torch, dtype))
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        model_folder = scratch / "model"
        meta = write_model(args.shape, model_folder, device, getattr(torch, dtype))
        data = write_data(scratch, args.prompts * args.steps, args.prompt_tokens)
        (scratch / "graded_reward.py").write_text(REWARD)
        config = {
            "seed": 0,
            "run_dir": str(scratch / "run"),
            "plugins": ["graded_reward.py"],
            "model": {"spec": str(model_folder), "dtype": dtype},
            "environments": [
                {
                    "agent_type": "dataset",
                    "agent_args": {
                        "data_files": str(data),
                        "prompt_column": "question",
                        "chat": False,
                        "eval_size": 0,
                        "reward_functions": [{"function": "graded_reward:digit_share"}],
                    },
                }
            ],
            "inference": {"generation": {"max_tokens": args.new_tokens, "ignore_eos": True}},
            "training": {
                "steps": args.steps,
                "prompts_per_step": args.prompts,
                "group_size": args.group_size,
                "master_dtype": "float32",
                "activation_checkpointing": device == "cuda",
            },
            "evaluation": {"at_start": False, "at_end": False, "every": 0},
            "checkpoint": {"every": 0},
            "logging": {"progress": "off", "tensorboard": False},
        }
        config_path = scratch / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "llmrl", "train", str(config_path)]
        command += [f"--set={override}" for override in args.set]
        subprocess.run(command, check=True, cwd=scratch)
        rows = [r for r in read_metrics(scratch / "run" / "metrics.jsonl") if "time/step_s" in r]
        prompt = prompt_tokens(model_folder, data)
        training = load_config(str(config_path), args.set).training
    forwards = 3 + (training.iterations > 1 or training.mini_batches > 1)  # with the old logprobs' pass
    samples = args.prompts * args.group_size
    print(
        f"\n{args.shape} ({sum(p.numel() for p in meta.parameters()) / 1e6:,.1f}M parameters, {dtype}) on {device}, "
        f"torch {torch.__version__}; {args.prompts} prompts x {args.group_size} samples, {prompt} prompt "
        f"tokens, {args.new_tokens} new; matrix peak {peak / 1e9:,.0f} GFLOP/s\n"
    )
    print(
        "| step | step (s) | rollouts (s) | update (s) | sync (s) | tokens/s | generation % peak "
        "| update % peak | memory peak / plan (GB) | mismatch KL |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        completion = round(r["rollout/response_length"])
        lengths = [(prompt, completion)] * samples
        generated = forward_flops(meta, lengths, shared_prompts=args.prompts)
        trained = forwards * forward_flops(meta, lengths, shared_prompts=0)
        print(
            f"| {r['step']} | {r['time/step_s']:.2f} | {r['time/rollouts_s']:.2f} | {r['time/train_s']:.2f} "
            f"| {r['time/sync_s']:.2f} | {samples * completion / r['time/step_s']:,.0f} "
            f"| {100 * generated / r['time/generate_s'] / peak:.1f} | {100 * trained / r['time/train_s'] / peak:.1f} "
            f"| {r['memory/peak_gb']:.1f} / {r['memory/plan_gb']:.1f} | {r.get('train/mismatch_kl', float('nan')):.2e} |"
        )


if __name__ == "__main__":
    main()
