"""The Tinker API's overhead over ``llmrl train``'s own update, and the two GRPO curves side by side.

    python bench/tinker_overhead.py [--steps 20] [--problems 32] [--group-size 8] [--lr 3e-3] [--rank 16]
                                    [--eval-every 10]

Runs the same GRPO training of the tiny model on 2-digit addition twice, one after the other, each with
LoRA of rank `--rank` (alpha 32, attention and MLP projections), `--problems` problems x `--group-size`
samples per step, AdamW at `--lr` on a cosine, std-normalised group advantages, the token-mean loss and
the gradient clipped at 1.0 (llmrl's defaults, examples/arithmetic_lora.yaml):

- ``llmrl train`` with examples/arithmetic_lora.yaml, in a process of its own;
- the SDK loop of tests/integration/tinker_loops.py (`LoopSettings.matching_llmrl`: the official `tinker`
  SDK, ``importance_sampling``) against ``python -m llmrl serve-tinker`` in a process of its own.

First table, one row per path; every figure is the median over the run's steps but the first (warm-up):
sequences and completion tokens in each update (groups whose samples all scored alike are left out of
both); update seconds: llmrl's ``time/train_s`` (logprobs, loss, backward, optimizer step), against the
SDK's round trip from sending ``forward_backward`` to the result of the ``optim_step`` sent after it;
ms per sequence, the update seconds over its sequences (the two runs draw different samples, so their
batches differ a little in size); weight sync seconds: llmrl's ``time/sync_s`` (the adapter pushed to
the embedded engine), against ``save_weights_and_get_sampling_client`` (the adapter merged into a copy of
the base, served by a new engine). The last row: the SDK's update of a single 2-token datum, what any
update costs however small (HTTP, the SDK's futures, the server's queue). The line under the table: the
SDK's ms per sequence over llmrl's.

Second table: held-out pass@1 (64 problems x 8 samples at temperature 1, the `test` split neither run
trains on) before training and every `--eval-every` steps, for each path. Both evaluate the same problems
but draw their own samples: step 0, the base model in both, shows how far sampling alone moves them.

On a shared machine both runs compete with whatever else runs; the server and the SDK client also share
the cores with each other, which a Tinker user's remote service would not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "integration"))

from servers import serving  # noqa: E402
from tinker_loops import BASE, LoopRecord, LoopSettings, grpo_loop  # noqa: E402

from llmrl.telemetry import read_metrics  # noqa: E402

FLOOR_REPEATS = 10
"""Updates of a single datum timed for the last row."""
LORA_ALPHA = 32
"""The alpha `llmrl serve-tinker` gives every adapter (and examples/arithmetic_lora.yaml its rank 16)."""


def llmrl_train(settings: LoopSettings, run_dir: Path) -> list[dict[str, float]]:
    """``llmrl train`` on the LoRA example with `settings`; its metrics rows."""
    overrides = {
        "run_dir": run_dir,
        "seed": settings.seed,
        "model.lora.rank": settings.rank,
        "model.lora.alpha": LORA_ALPHA,
        "training.steps": settings.steps,
        "training.prompts_per_step": settings.problems_per_step,
        "training.group_size": settings.group_size,
        "training.lr": settings.learning_rate,
        "training.lr_schedule": settings.lr_schedule,
        "evaluation.every": settings.eval_every,
        "evaluation.num_prompts": settings.eval_problems,
        "evaluation.samples_per_prompt": settings.eval_samples,
        "checkpoint.every": 0,
        "logging.progress": "off",
        "logging.tensorboard": "false",
    }
    command = [sys.executable, "-m", "llmrl", "train", str(REPO / "examples" / "arithmetic_lora.yaml")]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return read_metrics(run_dir / "metrics.jsonl")


def sdk_loop(settings: LoopSettings, scratch: Path) -> tuple[LoopRecord, list[float]]:
    """The SDK loop with `settings` against ``llmrl serve-tinker`` in its own process; then the seconds
    of `FLOOR_REPEATS` updates of one 2-token datum on a new adapter (what any call costs)."""
    import tinker
    from tinker import types

    from llmrl.models import load_model

    os.environ["TINKER_TELEMETRY"] = "0"
    tokenizer = load_model(BASE)[1]
    command = ("serve-tinker", "--model", BASE, "--storage", str(scratch / "storage"))
    with serving("llmrl", *command, log_path=scratch / "server.log") as base_url:
        service = tinker.ServiceClient(base_url=base_url, api_key="tml-local")
        record = grpo_loop(service, tokenizer, settings)
        training = service.create_lora_training_client(
            base_model=BASE, rank=settings.rank, train_unembed=False
        ).result(timeout=120)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2]),
            loss_fn_inputs={"target_tokens": [2, 3], "logprobs": [0.0, 0.0], "advantages": [0.0, 1.0]},
        )
        floor = []
        for _ in range(FLOOR_REPEATS):
            started = time.perf_counter()
            backward = training.forward_backward([datum], "importance_sampling")
            optimized = training.optim_step(types.AdamParams(learning_rate=settings.learning_rate))
            backward.result(timeout=120)
            optimized.result(timeout=120)
            floor.append(time.perf_counter() - started)
        service.close("success").result(timeout=60)
    return record, floor


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=10)
    args = parser.parse_args()
    settings = LoopSettings(
        steps=args.steps,
        problems_per_step=args.problems,
        group_size=args.group_size,
        learning_rate=args.lr,
        rank=args.rank,
        lr_schedule="cosine",
        eval_every=args.eval_every,
    ).matching_llmrl()

    with tempfile.TemporaryDirectory() as scratch:
        rows = llmrl_train(settings, Path(scratch) / "llmrl")
        record, floor = sdk_loop(settings, Path(scratch))

    steps = [row for row in rows if "train/num_sequences" in row]
    trainer = {
        "sequences": median_after_first([row["train/num_sequences"] for row in steps]),
        "tokens": median_after_first([row["train/num_tokens"] for row in steps]),
        "update_s": median_after_first([row["time/train_s"] for row in steps]),
        "ms_per_sequence": median_after_first(
            [1000 * row["time/train_s"] / row["train/num_sequences"] for row in steps]
        ),
        "sync_s": median_after_first([row["time/sync_s"] for row in steps]),
    }
    sdk = {
        "sequences": median_after_first(record.update_sequences),
        "tokens": median_after_first(record.update_tokens),
        "update_s": median_after_first(record.update_s),
        "ms_per_sequence": median_after_first(
            [1000 * s / n for s, n in zip(record.update_s, record.update_sequences, strict=True)]
        ),
        "sync_s": median_after_first(record.snapshot_s),
    }
    print(
        f"{settings.steps} steps of {settings.problems_per_step} problems x {settings.group_size} samples, "
        f"LoRA rank {settings.rank}, lr {settings.learning_rate:g} cosine, on "
        f"{os.cpu_count()} CPU cores\n"
    )
    print(
        "| path | sequences / update | completion tokens / update | update (s) | ms / sequence | weight sync (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name, figures in (("llmrl train", trainer), ("tinker SDK -> serve-tinker", sdk)):
        print(
            f"| {name} | {figures['sequences']:.0f} | {figures['tokens']:.0f} | {figures['update_s']:.3f} "
            f"| {figures['ms_per_sequence']:.2f} | {figures['sync_s']:.3f} |"
        )
    print(f"| tinker SDK, one 2-token datum | 1 | 1 | {median_after_first(floor):.3f} | - | - |")
    print(f"\nSDK update per sequence: {sdk['ms_per_sequence'] / trainer['ms_per_sequence']:.2f}x llmrl's\n")

    held_out = {
        int(row["step"]): row["eval/arithmetic/pass@1"] for row in rows if "eval/arithmetic/pass@1" in row
    }
    print("| step | llmrl train pass@1 | tinker SDK loop pass@1 |")
    print("|---|---|---|")
    for step in sorted(set(held_out) | set(record.held_out)):
        cells = [held_out.get(step), record.held_out.get(step)]
        print(f"| {step} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
