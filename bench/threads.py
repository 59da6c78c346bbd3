"""torch's CPU threads beside a busy process: the demo alone and beside a busy loop, with torch's
defaults and with llmrl's choice (`llmrl.threads`).

    python bench/threads.py [--steps 30] [--repeats 2]

Runs `llmrl train` (the built-in demo for `--steps` steps, with its evaluations before and after, no
checkpoints) in a fresh process per run, once alone ("idle") and once beside one CPU-bound process (a
Python busy loop started just before it, "busy"), for two settings:

- torch's defaults: `OMP_NUM_THREADS` set to the cores llmrl counts and `GOMP_SPINCOUNT=300000`,
  libgomp's own spin, both of which llmrl leaves as the user set them;
- llmrl's choice: neither set.

Repeats are interleaved, so that other work on the machine hits every setting alike. Printed per
setting and load: the median seconds of the whole command and of training (`summary.json`'s `seconds`:
the steps and the evaluations), and busy / idle of the training seconds. Both settings compute with the
same number of threads and the spin changes no number, so every run must log the same metrics (checked,
and said). The share of the CPUs that processes other than the run and its busy loop used during each
run is measured (Linux /proc/stat): timings taken beside more work than the one busy loop are flagged
as disturbed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmrl.telemetry import read_metrics
from llmrl.threads import usable_cores

LIBGOMP_SPIN_COUNT = "300000"
"""libgomp's spin when neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set."""

BUSY_LOOP = """
import os
parent = os.getppid()
while os.getppid() == parent:  # a bench stopped before it stops the loop leaves no orphan spinning
    for _ in range(1_000_000):
        pass
"""
"""The competing CPU-bound process: a pure-Python loop, one core's worth."""

DISTURBED = 0.10
"""Share of the CPUs other processes may use during a run before its timing is flagged."""


def settings() -> dict[str, dict[str, str]]:
    """Environment variables of each setting; the ones a setting leaves out are removed."""
    return {
        "torch's defaults": {"OMP_NUM_THREADS": str(usable_cores()), "GOMP_SPINCOUNT": LIBGOMP_SPIN_COUNT},
        "llmrl's choice": {},
    }


def run(steps: int, env: dict[str, str], busy: bool, run_dir: Path) -> dict:
    """One `llmrl train` in a fresh process; its timings, its metrics and the others' CPU share."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    command = [sys.executable, "-m", "llmrl", "train"] + [
        f"--set={override}"
        for override in (
            f"run_dir={run_dir}",
            f"training.steps={steps}",
            "checkpoint.every=0",
            "logging.progress=off",
            "logging.tensorboard=false",
        )
    ]
    machine_before, ours_before = machine_cpu_seconds(), children_cpu_seconds()
    loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) if busy else None
    began = time.perf_counter()
    try:
        subprocess.run(command, env=clean | env, check=True, stdout=subprocess.DEVNULL)
    finally:
        wall = time.perf_counter() - began
        if loop is not None:
            loop.kill()
            loop.wait()
    result = {"wall_s": wall, "train_s": json.loads((run_dir / "summary.json").read_text())["seconds"]}
    if machine_before is not None:
        others = machine_cpu_seconds() - machine_before - (children_cpu_seconds() - ours_before)
        result["others"] = max(others, 0.0) / (wall * (os.cpu_count() or 1))
    untimed = [
        {k: v for k, v in row.items() if not k.startswith(("time/", "memory/", "perf/"))}
        for row in read_metrics(run_dir / "metrics.jsonl")
    ]
    result["metrics"] = untimed
    return result


def machine_cpu_seconds() -> float | None:
    """CPU seconds every process of the machine has run since boot (Linux /proc/stat; None elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(
        f"the demo, {args.steps} steps per run; {usable_cores()} cores, {os.cpu_count()} CPUs; torch "
        f"{torch.__version__}; medians of {args.repeats} interleaved repeats\n",
        flush=True,
    )
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for load in ("idle", "busy"):
                for index, (name, env) in enumerate(settings().items()):
                    run_dir = Path(scratch) / f"{repeat}-{load}-{index}"
                    result = run(args.steps, env, load == "busy", run_dir)
                    results.setdefault((name, load), []).append(result)
                    print(
                        f"  {name}, {load}, repeat {repeat}: {result['wall_s']:.1f} s, training "
                        f"{result['train_s']:.1f} s, other processes {result.get('others', 0):.0%} of the CPUs",
                        flush=True,
                    )
    print(
        "\n| setting | idle: command (s) | idle: training (s) | busy: command (s) | busy: training (s) | busy / idle |"
    )
    print("|---|---|---|---|---|---|")
    for name in settings():
        idle, busy = (
            {key: statistics.median(r[key] for r in results[(name, load)]) for key in ("wall_s", "train_s")}
            for load in ("idle", "busy")
        )
        print(
            f"| {name} | {idle['wall_s']:.1f} | {idle['train_s']:.1f} | {busy['wall_s']:.1f} "
            f"| {busy['train_s']:.1f} | {busy['train_s'] / idle['train_s']:.1f}x |"
        )
    every = [r for runs in results.values() for r in runs]
    same = all(r["metrics"] == every[0]["metrics"] for r in every)
    print(f"\nmetrics (all but times, speeds and memory) identical in every run: {'yes' if same else 'no'}")
    shares = [r["others"] for r in every if "others" in r]
    if shares:
        print(
            f"other processes used {statistics.median(shares):.0%} of the CPUs in the median run, "
            f"{max(shares):.0%} at most" + (" (timings disturbed)." if max(shares) > DISTURBED else ".")
        )


if __name__ == "__main__":
    main()
