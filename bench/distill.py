"""On-policy distillation vs GRPO on the demo task, against the teacher itself.

    python bench/distill.py [--teacher runs/demo] [--steps 60] [--seeds 0 1 2] [--signals top_k sampled]
                            [--served] [--no-grpo]

The student is the untrained `tiny://arithmetic`; the teacher the demo's trained model (`--teacher`,
a run or checkpoint folder; when it has no checkpoint, the demo is trained first into a scratch
folder, about 3 minutes on 2 CPU cores with OMP_NUM_THREADS=1). For each seed, in a fresh process
each, `examples/arithmetic_distill.yaml` runs `--steps` steps with distillation, once per
`--signals` (`distillation.signal`: `top_k`, `sampled`), and again with GRPO at the same settings (no
`distillation` section, the rewards alone); the teacher is evaluated on the same held-out problems
(64 problems x 8 samples, the seed's). With `--served` the students reach the teacher through
`llmrl serve-inference` (`examples/arithmetic_distill_served.yaml`, `distillation.teacher_server`),
which the bench starts; `--no-grpo` leaves the GRPO runs out. Prints a markdown table: held-out pass@1 of the teacher, of
each distilled student and of the GRPO student, and each distillation run's reverse KL to the
teacher (`distill/reverse_kl`, mean over sampled tokens) over its first and last 10 steps. Figures:
docs/benchmarks.md, "On-policy distillation against GRPO" (about 6 minutes a seed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from llmrl.config import ServeConfig
from llmrl.inference.managed_server import start_model_server
from llmrl.telemetry import read_metrics
from llmrl.trainer import checkpoint as ckpt

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic_distill.yaml"
EXAMPLE_SERVED = EXAMPLE.with_name("arithmetic_distill_served.yaml")
QUIET = ["logging.progress=off", "logging.tensorboard=false", "checkpoint.every=0"]
RUN = """
import sys
from llmrl.config import load_config
from llmrl.trainer import Trainer
path, *overrides = sys.argv[1:]
Trainer(load_config(path or None, overrides)).run()
"""


def train(run_dir: Path, config: Path | None, *overrides: str) -> None:
    subprocess.run(
        [sys.executable, "-c", RUN, str(config or ""), f"run_dir={run_dir}", *QUIET, *overrides],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def held_out_pass_at_1(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["eval_end"]["arithmetic"]["pass@1"]


def teacher_folder(teacher: Path, scratch: Path) -> Path:
    """The teacher's run folder (a model is taken from its latest checkpoint); the demo is trained into
    `scratch` when `teacher` has none."""
    if ckpt.latest_checkpoint(teacher) is None:
        print(f"{teacher} holds no trained model: training the demo into a scratch folder first", flush=True)
        train(scratch / "demo", None)
        return scratch / "demo"
    return teacher


@contextlib.contextmanager
def teacher_server(teacher: Path, log: Path) -> Iterator[str]:
    """`llmrl serve-inference --model teacher` until the block ends; yields its API root."""
    server = start_model_server(ServeConfig(model=str(teacher)), log_path=log, seed=0)
    try:
        yield server.base_url
    finally:
        server.close()


def compare(
    seed: int, steps: int, teacher: Path, scratch: Path, signals: list[str], served: str | None, grpo: bool
) -> dict[str, float]:
    """One seed's runs; `served`: the teacher server's URL (None: the teacher loaded in each run)."""
    common = [f"seed={seed}", f"training.steps={steps}", "evaluation.at_start=false", "evaluation.every=0"]
    train(
        scratch / f"teacher{seed}",
        EXAMPLE,
        *common,
        f"model.spec={teacher}",
        "training.steps=0",
        "distillation=null",
    )
    results = {"teacher": held_out_pass_at_1(scratch / f"teacher{seed}")}
    for signal in signals:
        run = scratch / f"{signal}{seed}"
        if served is None:
            train(run, EXAMPLE, *common, f"distillation.teacher={teacher}", f"distillation.signal={signal}")
        else:
            url = f"distillation.teacher_server.url={served}"
            train(run, EXAMPLE_SERVED, *common, url, f"distillation.signal={signal}")
        rows = [r for r in read_metrics(run / "metrics.jsonl") if "distill/reverse_kl" in r]
        results[signal] = held_out_pass_at_1(run)
        results[f"{signal}_kl_first"] = statistics.mean(r["distill/reverse_kl"] for r in rows[:10])
        results[f"{signal}_kl_last"] = statistics.mean(r["distill/reverse_kl"] for r in rows[-10:])
    if grpo:
        train(scratch / f"grpo{seed}", EXAMPLE, *common, "distillation=null")
        results["grpo"] = held_out_pass_at_1(scratch / f"grpo{seed}")
    return results


def row(name: object, f: dict[str, float], signals: list[str]) -> str:
    students = [*signals, *(["grpo"] if "grpo" in f else [])]
    cells = [f"{f['teacher']:.3f}", *(f"{f[s]:.3f}" for s in students)]
    cells += [f"{100 * (f[s] - f['teacher']):+.1f}" for s in students]
    cells += [f"{f[f'{s}_kl_first']:.3f} -> {f[f'{s}_kl_last']:.3f}" for s in signals]
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--teacher", type=Path, default=Path("runs/demo"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--signals",
        nargs="+",
        choices=["top_k", "sampled"],
        default=["top_k", "sampled"],
        help="distillation.signal of each distillation run",
    )
    parser.add_argument("--served", action="store_true", help="the teacher behind llmrl serve-inference")
    parser.add_argument("--no-grpo", action="store_true", help="no GRPO runs")
    args = parser.parse_args()
    signals = args.signals
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        teacher = teacher_folder(args.teacher, scratch)
        print(f"teacher {teacher}; {args.steps} steps per run; held-out pass@1 (64 problems x 8 samples)\n")
        names = [*signals, *([] if args.no_grpo else ["GRPO"])]
        print(
            "| seed | teacher | "
            + " | ".join(names)
            + " | "
            + " | ".join(f"{n} - teacher" for n in names)
            + " | "
            + " | ".join(f"{s} reverse KL first 10 -> last 10 steps" for s in signals)
            + " |"
        )
        print("|---" * (2 + 2 * len(names) + len(signals)) + "|")
        results = []
        with contextlib.ExitStack() as stack:
            served = (
                stack.enter_context(teacher_server(teacher, scratch / "teacher.log")) if args.served else None
            )
            for seed in args.seeds:
                results.append(compare(seed, args.steps, teacher, scratch, signals, served, not args.no_grpo))
                print(row(seed, results[-1], signals), flush=True)
        print(row("mean", {key: statistics.mean(f[key] for f in results) for key in results[0]}, signals))


if __name__ == "__main__":
    main()
