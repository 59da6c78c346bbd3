"""Build the embedded tiny model from scratch and print what it costs and how well it adds.

    python bench/tiny_model.py              # fresh build in a temporary folder: time, size, accuracy
    python bench/tiny_model.py --curve 900  # warm-up without the early stop: the whole validation curve

Accuracy is on held-out 2-digit additions: sampled at temperature 1 (the setting GRPO samples at;
mean and spread over several sampling seeds) and greedy (`generate(do_sample=False)`). The curve
mode shows why the warm-up stops on a measurement: accuracy climbs from a few percent to most of
the way within a couple of hundred steps once the model starts to carry.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

import torch

from llmrl.models import TINY_MODELS, load_model
from llmrl.models.tiny_build import build_tiny_model, evaluate_accuracy
from llmrl.rewards.arithmetic import sample_problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--curve", type=int, metavar="STEPS", help="run STEPS warm-up steps, no early stop")
    parser.add_argument("--problems", type=int, default=256, help="held-out problems to evaluate on")
    parser.add_argument("--seeds", type=int, default=5, help="sampling seeds for the sampled accuracy")
    args = parser.parse_args()

    recipe = TINY_MODELS["arithmetic"]
    if args.curve:
        recipe = dataclasses.replace(recipe, max_steps=args.curve, target_accuracy=float("inf"))
    print(f"torch {torch.__version__}, {recipe.threads} build threads, recipe {recipe.recipe_id}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        info = build_tiny_model(folder, recipe)
        model, tokenizer = load_model(folder)

    print("\nwarm-up checks (validation: train-split problems held back from the warm-up)")
    print(f"{'step':>6} {'loss':>7} {'expected acc':>13}")
    for check in info["checks"]:
        print(f"{check['step']:>6} {check['loss']:>7.3f} {check['expected_accuracy']:>13.1%}")

    heldout = sample_problems(args.problems, digits=recipe.digits, split="test", seed=0)
    sampled = [evaluate_accuracy(model, tokenizer, heldout, sample=True, seed=s) for s in range(args.seeds)]
    greedy = evaluate_accuracy(model, tokenizer, heldout, sample=False)
    print(f"\nbuild time:           {info['build_seconds']:.1f} s (tokenizer, warm-up, evaluation, save)")
    print(f"parameters:           {info['params']:,} (vocabulary {info['vocab_size']})")
    print(f"warm-up steps:        {info['warmup_steps_run']} x {recipe.batch_size} problems")
    print(f"held-out {recipe.digits}-digit addition, {len(heldout)} problems:")
    print(
        f"  sampled (T=1):      {statistics.mean(sampled):.1%} mean over {len(sampled)} seeds "
        f"(min {min(sampled):.1%}, max {max(sampled):.1%})"
    )
    print(f"  greedy:             {greedy:.1%}")


if __name__ == "__main__":
    main()
