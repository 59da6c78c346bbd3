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

Then it separates the routing part of the mismatch, which the runs' KL mixes with bfloat16's other
differences: per seed, the engine (bfloat16 weights, recording routes) samples 32 problems x 8, and
the trainer's forward (float32 weights under bfloat16 autocast, as `llmrl train` computes) scores the
sampled tokens twice, routing live and replaying the engine's routes. A sampled token is *affected*
when the trainer's live routers chose other experts than the engine's, in any layer, at its position
or an earlier one of its sequence (attention carries a flip forward). The second table gives the
share of affected tokens (and of those whose own position flipped) and the mismatch KL (k3 of trainer
against engine logprobs) over each of them, the unaffected tokens, and all, live and replayed: what
replay changes on the affected tokens is the routing part of the mismatch.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from llmrl.envs.arithmetic import ArithmeticAgent
from llmrl.inference.engine import LocalEngine
from llmrl.models import load_model
from llmrl.models.routing import RouteRecorder, RouteReplay, routes_for, routes_from_wire
from llmrl.telemetry import read_metrics
from llmrl.types import GenerationArgs, InferenceRequest

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


def routing_part(seed: int, prompts: int = 32, samples: int = 8) -> dict[str, dict[str, float]]:
    """Mismatch KL over affected and unaffected sampled tokens, routing live and replayed (docstring)."""
    model, tokenizer = load_model("tiny://arithmetic-moe")  # float32: the trainer's master weights
    model.eval()
    engine = LocalEngine(copy.deepcopy(model).to(torch.bfloat16), tokenizer, record_routes=True, seed=seed)
    problems = random.Random(seed).sample(ArithmeticAgent().prompts(), prompts)
    args = GenerationArgs(max_tokens=8, temperature=1.0)
    responses = [
        response
        for problem in problems
        for response in engine.generate(
            InferenceRequest(prompt=problem.prompt, generation_args=args, n=samples)
        )
    ]
    engine.close()
    replay = RouteReplay(model)
    gaps: dict[str, list[torch.Tensor]] = {"live": [], "replayed": []}
    affected: list[torch.Tensor] = []
    flipped_here: list[torch.Tensor] = []
    for response in responses:
        ids = response.prompt_token_ids + response.token_ids
        recorded = routes_for(
            routes_from_wire(response.routed_experts), len(ids), replay.layers, replay.top_k
        )
        first = len(response.prompt_token_ids) - 1  # the position that predicts the first sampled token
        engine_logprobs = torch.tensor(response.logprobs, dtype=torch.float32)
        for mode, replayed in (("live", False), ("replayed", True)):
            with (
                torch.no_grad(),
                torch.autocast("cpu", dtype=torch.bfloat16),
                RouteRecorder(model) as live_routes,  # entered first: its hook sees the live top k
                replay.routes(recorded, replay=replayed),
            ):
                logits = model(input_ids=torch.tensor([ids])).logits[0, first:-1].float()
            trainer_logprobs = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(response.token_ids)[:, None]
            )[:, 0]
            log_ratio = trainer_logprobs - engine_logprobs
            gaps[mode].append(log_ratio.exp() - 1 - log_ratio)
            if not replayed:
                live = live_routes.take()[: len(ids) - 1].sort(-1).values
                differs = (live != recorded[: len(ids) - 1].sort(-1).values).any(-1).any(-1)  # per position
                affected.append(differs.cummax(0).values[first:])
                flipped_here.append(differs[first:])
    mask, here = torch.cat(affected), torch.cat(flipped_here)
    result = {}
    for mode, values in gaps.items():
        kl = torch.cat(values)
        result[mode] = {
            "affected_share": float(mask.float().mean()),
            "affected": float(kl[mask].mean()) if mask.any() else float("nan"),
            "here_share": float(here.float().mean()),
            "here": float(kl[here].mean()) if here.any() else float("nan"),
            "unaffected": float(kl[~mask].mean()),
            "all": float(kl.mean()),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--routing-part-only", action="store_true", help="skip the training runs")
    args = parser.parse_args()
    if not args.routing_part_only:
        training_runs(args.steps, args.seeds)
    print(
        "\n| seed | affected tokens | flipped at their position | routing | mismatch KL, affected "
        "| flipped at their position | unaffected | all |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        for mode, f in routing_part(seed).items():
            print(
                f"| {seed} | {f['affected_share']:.2%} | {f['here_share']:.2%} | {mode} | {f['affected']:.2e} "
                f"| {f['here']:.2e} | {f['unaffected']:.2e} | {f['all']:.2e} |",
                flush=True,
            )


def training_runs(steps: int, seeds: list[int]) -> None:
    print(f"{steps} steps per run\n")
    print("| router_replay | seed | routing differs (any layer) | mismatch KL | pass@1 before -> after |")
    print("|---|---|---|---|---|")
    results: dict[str, list[dict[str, float]]] = {"observe": [], "true": []}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in seeds:
            for replay in results:
                f = run(replay, seed, steps, Path(scratch) / f"{replay}-{seed}")
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
