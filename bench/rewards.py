"""Scoring with a reward model: called once per completion against once per group, completions per second.

    python bench/rewards.py [--groups 32] [--group-size 8] [--numbers 16] [--repeats 3]

A random sequence classifier of the tiny model's shape (`tiny://arithmetic`'s config, one label) is
saved to a temporary folder and named by a dataset environment's reward entry ``{model: FOLDER}``,
once with ``batch: completion`` and once with the default ``batch: group``. Each scores the same
`--groups` groups of `--group-size` completions (replies of `--numbers` numbers to a chat prompt)
through the agent's own scoring (`DatasetAgent.score_episodes`: worker threads, ``reward_concurrency``
calls at a time), all groups at once as a training step's are. Prints a markdown table: the best of `--repeats`
timed rounds (one untimed round first), in completions per second.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import datasets
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from llmrl.agents.dataset import DatasetAgent
from llmrl.models import tiny_model_path
from llmrl.quiet import quiet_libraries
from llmrl.types import InferenceResponse


def save_reward_model(folder: str) -> None:
    """A random one-label classifier of the tiny model's shape, with its tokenizer."""
    source = tiny_model_path("arithmetic")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(source, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)


def completions_per_second(
    agent: DatasetAgent, groups: int, group_size: int, numbers: int, repeats: int
) -> float:
    problems = agent.train_problems[:groups]
    responses = [
        [
            InferenceResponse(
                text=" ".join(str((g * 7 + i * 13 + t) % 100) for t in range(numbers)),
                prompt_token_ids=[1],
                token_ids=[1] * numbers,
                finish_reason="stop",
            )
            for i in range(group_size)
        ]
        for g in range(len(problems))
    ]

    async def score_all() -> None:
        await asyncio.gather(*(agent.score_episodes(r, p) for r, p in zip(responses, problems, strict=True)))

    asyncio.run(score_all())  # warm: threads, the first forward's allocations
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        asyncio.run(score_all())
        best = min(best, time.perf_counter() - started)
    return len(problems) * group_size / best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--numbers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    quiet_libraries()  # no progress bars between the rows
    rows = [{"prompt": f"What is {a} + {a + 7}?", "answer": str(2 * a + 7)} for a in range(args.groups + 8)]
    with tempfile.TemporaryDirectory() as folder:
        save_reward_model(folder)
        print(
            f"torch threads: {torch.get_num_threads()}; {args.groups} groups x {args.group_size} completions"
        )
        print("| calls | completions/s |\n|---|---|")
        for batch in ("completion", "group"):
            agent = DatasetAgent(
                dataset=datasets.Dataset.from_list(rows),
                reward_functions=[{"model": folder, "batch": batch, "device": "cpu"}],
                eval_size=8,
            )
            rate = completions_per_second(agent, args.groups, args.group_size, args.numbers, args.repeats)
            print(f"| one per {batch} | {rate:.0f} |")


if __name__ == "__main__":
    main()
