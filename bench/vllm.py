"""The demo (or another example) trained with each inference backend in one run, over seeds.

    python bench/vllm.py [--steps 30] [--backends embedded,colocate,http] [--seeds 0,1,2]
                         [--config examples/arithmetic.yaml] [--out /tmp/llmrl-bench-vllm]

Trains `--config` (default: the built-in arithmetic demo, 32 prompts x 8 samples a step) for
`--steps` steps with each backend: `embedded` (`inference.type: local`), `colocate` (vLLM's engine
in the trainer's process, `inference.vllm.mode: colocate`), and managed vLLM servers with each
weight transport named (`http`, `disk`), each seed in a fresh run folder, evaluation only at the
start and the end. From each run's metrics.jsonl it prints the median step time and the median time
of each phase (rollouts: generation and reward; train; sync: the weight sync after the step), the
sync's share of a step, the held-out accuracy change, and the largest trainer/inference mismatch
(`train/mismatch_kl`); then, per backend, the mean and spread of the accuracy change over the seeds
and its median step time against the embedded engine's. The first step is left out of the medians
(vLLM compiles its decode graph then). vLLM needs `bash scripts/setup.sh vllm`; a server's or
engine's start-up is reported separately (wall time of the run minus its steps).
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


BACKENDS = {
    "embedded": [],
    "colocate": ["inference.type=vllm", "inference.vllm.mode=colocate", "inference.vllm.max_model_len=256"],
    "http": ["inference.type=vllm", "inference.vllm.transport=http", "inference.vllm.max_model_len=256"],
    "disk": ["inference.type=vllm", "inference.vllm.transport=disk", "inference.vllm.max_model_len=256"],
}


def run(name: str, out: Path, config: str, steps: int, overrides: list[str]) -> dict[str, float]:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "llmrl",
        "train",
        config,
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
    env = next(iter(summary["eval_end"]))
    result["accuracy_change"] = summary["eval_end"][env]["pass@1"] - summary["eval_start"][env]["pass@1"]
    result["startup_and_evals_s"] = wall - sum(line["time/step_s"] for line in lines if "time/step_s" in line)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backends", default="embedded,colocate,http")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--config", default="examples/arithmetic.yaml")
    parser.add_argument("--out", type=Path, default=Path("/tmp/llmrl-bench-vllm"))
    args = parser.parse_args()
    backends, seeds = args.backends.split(","), [int(seed) for seed in args.seeds.split(",")]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise SystemExit(f"--backends: unknown {unknown}; choose from {sorted(BACKENDS)}")
    runs: dict[tuple[str, int], dict[str, float]] = {}
    for seed in seeds:
        for backend in backends:
            overrides = [f"seed={seed}", *BACKENDS[backend]]
            name = f"{backend}-seed{seed}"
            runs[backend, seed] = run(
                name, args.out, args.config, args.steps, [arg for o in overrides for arg in ("--set", o)]
            )
            print(
                f"{name}: {json.dumps({k: round(v, 4) for k, v in runs[backend, seed].items()})}", flush=True
            )
    print(f"\n{args.config}: {args.steps} steps, medians over steps 2..{args.steps}")
    header = (
        f"{'backend':<10} {'seed':>4} {'step s':>7} {'rollouts s':>10} {'train s':>8} {'sync s':>7} "
        f"{'sync/step':>9} {'mismatch kl':>11} {'acc change':>10} {'start+evals s':>13}"
    )
    print(header)
    for (backend, seed), r in runs.items():
        print(
            f"{backend:<10} {seed:>4} {r['step_s']:>7.3f} {r['rollouts_s']:>10.3f} {r['train_s']:>8.3f} "
            f"{r['sync_s']:>7.3f} {r['sync_share']:>9.1%} {r['mismatch_kl_max']:>11.2e} "
            f"{r['accuracy_change']:>+10.3f} {r['startup_and_evals_s']:>13.1f}"
        )
    print(f"\n{'backend':<10} {'acc change: mean':>16} {'sd':>6} {'step s':>7} {'x embedded':>10}")
    embedded = [runs[b, s]["step_s"] for (b, s) in runs if b == "embedded"]
    for backend in backends:
        changes = [runs[backend, seed]["accuracy_change"] for seed in seeds]
        step_s = statistics.median(runs[backend, seed]["step_s"] for seed in seeds)
        spread = statistics.stdev(changes) if len(changes) > 1 else 0.0
        ratio = f"{step_s / statistics.median(embedded):>10.2f}" if embedded else f"{'-':>10}"
        print(f"{backend:<10} {statistics.mean(changes):>+16.3f} {spread:>6.3f} {step_s:>7.3f} {ratio}")


if __name__ == "__main__":
    main()
