"""The demo trained on managed vLLM beside the embedded engine, in one run.

    python bench/vllm.py [--steps 30] [--transports http,disk] [--out /tmp/llmrl-bench-vllm]

Trains the built-in arithmetic demo (tiny model, 32 prompts x 8 samples a step) for `--steps`
steps with `inference.type: local` and then with `inference.type: vllm` for each transport, each in
a fresh run folder, evaluation only at the start and the end. From each run's metrics.jsonl it
prints the median step time and the median time of each phase (rollouts: generation and reward;
train; sync: the weight sync after the step), the sync's share of a step, the held-out accuracy
change, and the largest trainer/inference mismatch (`train/mismatch_kl`). The first step is left
out of the medians (vLLM compiles its decode graph then). Managed vLLM needs `bash scripts/setup.sh
vllm`; its server start-up is reported separately (wall time of the run minus its steps).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("time/rollouts_s", "time/train_s", "time/sync_s")


def run(name: str, out: Path, steps: int, overrides: list[str]) -> dict[str, float]:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "llmrl",
        "train",
        "examples/arithmetic.yaml",
        "--set",
        f"run_dir={run_dir}",
        "--set",
        f"training.steps={steps}",
        "--set",
        "evaluation.every=0",
        "--set",
        "logging.progress=off",
        "--set",
        "checkpoint.every=0",
        *overrides,
    ]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_lines = [line for line in lines if "time/step_s" in line][1:]
    summary = json.loads((run_dir / "summary.json").read_text())
    result = {"step_s": statistics.median(line["time/step_s"] for line in step_lines)}
    for phase in PHASES:
        result[phase.removeprefix("time/")] = statistics.median(line.get(phase, 0.0) for line in step_lines)
    result["sync_share"] = result["sync_s"] / result["step_s"]
    result["mismatch_kl_max"] = max(abs(line.get("train/mismatch_kl", 0.0)) for line in step_lines)
    result["accuracy_change"] = (
        summary["eval_end"]["arithmetic"]["pass@1"] - summary["eval_start"]["arithmetic"]["pass@1"]
    )
    result["startup_and_evals_s"] = wall - sum(line["time/step_s"] for line in lines if "time/step_s" in line)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--transports", default="http,disk")
    parser.add_argument("--out", type=Path, default=Path("/tmp/llmrl-bench-vllm"))
    args = parser.parse_args()
    runs = {"embedded": run("embedded", args.out, args.steps, [])}
    for transport in args.transports.split(","):
        runs[f"vllm-{transport}"] = run(
            f"vllm-{transport}",
            args.out,
            args.steps,
            [
                "--set",
                "inference.type=vllm",
                "--set",
                f"inference.vllm.transport={transport}",
                "--set",
                "inference.vllm.max_model_len=256",
            ],
        )
    print(f"{args.steps} steps of the demo (32 prompts x 8), medians over steps 2..{args.steps}")
    header = (
        f"{'engine':<12} {'step s':>7} {'rollouts s':>10} {'train s':>8} {'sync s':>7} {'sync/step':>9} "
        f"{'mismatch kl':>11} {'acc change':>10} {'start+evals s':>13}"
    )
    print(header)
    for name, r in runs.items():
        print(
            f"{name:<12} {r['step_s']:>7.3f} {r['rollouts_s']:>10.3f} {r['train_s']:>8.3f} {r['sync_s']:>7.3f} "
            f"{r['sync_share']:>9.1%} {r['mismatch_kl_max']:>11.2e} {r['accuracy_change']:>+10.3f} "
            f"{r['startup_and_evals_s']:>13.1f}"
        )


if __name__ == "__main__":
    main()
