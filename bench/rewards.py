"""Scoring with a model: a reward model called once per completion against once per group, and an LLM
judge asked one request at a time against 16; completions per second.

    python bench/rewards.py [--groups 32] [--group-size 8] [--numbers 16] [--repeats 3] [--judge-latency-s 0.1]

A random sequence classifier of the tiny model's shape (`tiny://arithmetic`'s config, one label) is
saved to a temporary folder and named by a dataset environment's reward entry ``{model: FOLDER}``,
once with ``batch: completion`` and once with the default ``batch: group``. Each scores the same
`--groups` groups of `--group-size` completions (replies of `--numbers` numbers to a chat prompt)
through the agent's own scoring (`DatasetAgent.score_episodes`: worker threads, ``reward_concurrency``
calls at a time), all groups at once as a training step's are. Prints a markdown table: the best of `--repeats`
timed rounds (one untimed round first), in completions per second.

The judge (``{judge: {url, max_concurrent, cache_size: 0}}``) grades the same completions through the
same scoring, at ``max_concurrent`` 1 and 16, behind two servers: a stand-in for a judge behind an API
(an OpenAI-compatible endpoint in this process that answers CORRECT after `--judge-latency-s`), and
llmrl's own inference server running ``tiny://arithmetic`` in a process of its own
(``llmrl serve-inference``: real generation, `--judge-tokens` tokens per answer, read by the score
parser).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import datasets
import torch
import uvicorn
from fastapi import FastAPI
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from llmrl.agents.dataset import DatasetAgent
from llmrl.config import ServeConfig
from llmrl.inference.managed_server import start_model_server
from llmrl.models import tiny_model_path
from llmrl.processes import free_port
from llmrl.quiet import quiet_libraries
from llmrl.types import InferenceResponse


def save_reward_model(folder: str) -> None:
    """A random one-label classifier of the tiny model's shape, with its tokenizer."""
    source = tiny_model_path("arithmetic")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(source, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)


def number_replies(groups: int, group_size: int, numbers: int) -> list[list[str]]:
    """Each group's completions: replies of `numbers` numbers, distinct within a group."""
    return [
        [" ".join(str((g * 7 + i * 13 + t) % 100) for t in range(numbers)) for i in range(group_size)]
        for g in range(groups)
    ]


def completions_per_second(agent: DatasetAgent, replies: list[list[str]], repeats: int) -> float:
    problems = agent.train_problems[: len(replies)]
    responses = [
        [
            InferenceResponse(
                text=text, prompt_token_ids=[1], token_ids=[1] * len(text.split()), finish_reason="stop"
            )
            for text in group
        ]
        for group in replies
    ]

    async def score_all() -> None:
        scored = await asyncio.gather(
            *(agent.score_episodes(r, p, None) for r, p in zip(responses, problems, strict=True))
        )
        failures = [reward for group in scored for reward in group if isinstance(reward, BaseException)]
        if failures:
            raise SystemExit(f"{len(failures)} completions were not scored; the first: {failures[0]}")

    asyncio.run(score_all())  # warm: threads, the first forward's allocations
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        asyncio.run(score_all())
        best = min(best, time.perf_counter() - started)
    return sum(len(group) for group in replies) / best


def api_judge(latency_s: float) -> FastAPI:
    """A judge behind an API, as far as the client can tell: CORRECT after `latency_s`."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "judge"}]}

    @app.post("/v1/chat/completions")
    async def grade(body: dict) -> dict:
        await asyncio.sleep(latency_s)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "CORRECT"}}]}

    return app


@contextlib.contextmanager
def served_in_thread(app: FastAPI) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join()


@contextlib.contextmanager
def served_tiny_model() -> Iterator[str]:
    """``llmrl serve-inference --model tiny://arithmetic`` in a process of its own; yields its API root."""
    with tempfile.TemporaryDirectory() as folder:
        server = start_model_server(
            ServeConfig(model="tiny://arithmetic"), log_path=Path(folder) / "server.log", seed=0
        )
        try:
            yield server.base_url
        finally:
            server.close()


def judge_rates(rows: list[dict], args: argparse.Namespace) -> None:
    """The judge's completions per second behind each server, one request at a time and 16."""
    # The tiny model answers a sum with a number, which the score parser reads: its completions are sums.
    sums = [[f"What is {g + 11} + {i + 23}?" for i in range(args.group_size)] for g in range(args.groups)]
    judges = [
        (
            f"an API ({args.judge_latency_s:g} s per answer)",
            served_in_thread(api_judge(args.judge_latency_s)),
            {},
            number_replies(args.groups, args.group_size, args.numbers),
        ),
        (
            "llmrl serve-inference, tiny://arithmetic",
            served_tiny_model(),
            {"template": "{completion}", "parser": "score", "max_tokens": args.judge_tokens},
            sums,
        ),
    ]
    print("\n| judge | max_concurrent 1, completions/s | max_concurrent 16, completions/s |\n|---|---|---|")
    for label, serving, settings, replies in judges:
        with serving as url:
            rates = []
            for concurrency in (1, 16):
                judge = {"url": url, "max_concurrent": concurrency, "cache_size": 0, **settings}
                agent = DatasetAgent(
                    dataset=datasets.Dataset.from_list(rows), reward_functions=[{"judge": judge}], eval_size=8
                )
                rates.append(completions_per_second(agent, replies, args.repeats))
        print(f"| {label} | {rates[0]:.0f} | {rates[1]:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--numbers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--judge-latency-s", type=float, default=0.1)
    parser.add_argument("--judge-tokens", type=int, default=8)
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
            replies = number_replies(args.groups, args.group_size, args.numbers)
            rate = completions_per_second(agent, replies, args.repeats)
            print(f"| one per {batch} | {rate:.0f} |")
    judge_rates(rows, args)


if __name__ == "__main__":
    main()
