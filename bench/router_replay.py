"""Router replay on the small MoE in bfloat16: routing disagreement, mismatch KL and held-out gain,
with and without replay.

    python bench/router_replay.py [--steps 60] [--seeds 0 1 2]

Runs `examples/arithmetic_moe.yaml` (tiny://arithmetic-moe, bfloat16, 32 prompts x 8 samples) for
`--steps` steps per seed twice, each in a fresh process: ``training.router_replay: observe`` (the
trainer routes live and counts where its routers part from the engine's) and ``true`` (it replays the
engine's routes). Prints a markdown table per run and the means: the share of sampled-and-read tokens
whose live routing differs from the engine's in any MoE layer (`train/routing/differs_any_layer`, mean over
steps: how much replay has to correct), the mismatch KL between the engine's and the trainer's
logprobs of the sampled tokens (`train/mismatch_kl`, mean over steps), and held-out pass@1 before and
after (64 problems x 8 samples).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from llmrl.telemetry import read_metrics

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic_moe.yaml"


def run(replay: str, seed: int, steps: int, run_dir: Path) -> dict[str, float]:
    settings = {
        "seed": seed,
        "run_dir": str(run_dir),
        "training.steps": steps,
        "training.router_replay": replay,
        "evaluation.every": 0,
        "checkpoint.every": 0,
        "logging.progress": "off",
        "logging.tensorboard": "false",
    }
    overrides = [item for key, value in settings.items() for item in ("--set", f"{key}={value}")]
    subprocess.run(
        [sys.executable, "-m", "llmrl", "train", str(EXAMPLE), *overrides],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "differs": statistics.mean(r["train/routing/differs_any_layer"] for r in rows),
        "mismatch_kl": statistics.mean(r["train/mismatch_kl"] for r in rows),
        "before": summary["eval_start"]["arithmetic"]["pass@1"],
        "after": summary["eval_end"]["arithmetic"]["pass@1"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    print(f"{args.steps} steps per run\n")
    print("| router_replay | seed | routing differs (any layer) | mismatch KL | pass@1 before -> after |")
    print("|---|---|---|---|---|")
    results: dict[str, list[dict[str, float]]] = {"observe": [], "true": []}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for replay in results:
                f = run(replay, seed, args.steps, Path(scratch) / f"{replay}-{seed}")
                results[replay].append(f)
                print(
                    f"| {replay} | {seed} | {f['differs']:.2%} | {f['mismatch_kl']:.2e} "
                    f"| {f['before']:.3f} -> {f['after']:.3f} |",
                    flush=True,
                )
    for replay, runs in results.items():
        mean = {key: statistics.mean(r[key] for r in runs) for key in runs[0]}
        print(
            f"| {replay} | mean | {mean['differs']:.2%} | {mean['mismatch_kl']:.2e} "
            f"| {mean['before']:.3f} -> {mean['after']:.3f} |"
        )


if __name__ == "__main__":
    main()
