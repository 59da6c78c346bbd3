"""The inference server under load, and how long a weight sync takes.

    python bench/serving.py [--requests 200] [--max-tokens 16] [--sync-repeats 3]

1. Load: starts ``llmrl serve-inference --model tiny://arithmetic`` on loopback and sends
   `--requests` chat completions at once (one httpx client, no connection limit), each a different
   2-digit addition sampled with its own seed. Reports requests/s over the whole burst, p50/p99
   latency, and how many requests failed or came back without token ids (must be 0: nothing lost).
2. Weight sync: `OpenAIInterface.update_weights` of a state dict to a server, timed from the
   client (write or stream + load + answer), best of `--sync-repeats`, for the tiny model and for a
   randomly initialised ~100M-parameter Qwen2 (hidden 768, 12 layers, 32k vocabulary), both as a
   file in a shared `--weights-dir` and streamed over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
import transformers

from llmrl.inference.openai import OpenAIInterface
from llmrl.models import tiny_model_path
from llmrl.processes import free_port


@contextlib.contextmanager
def inference_server(model: str, weights_dir: Path | None = None) -> Iterator[str]:
    """A `llmrl serve-inference` process on loopback; yields its base URL (…/v1) and stops it."""
    port = free_port()
    extra = ["--weights-dir", str(weights_dir)] if weights_dir else []
    process = subprocess.Popen(
        [sys.executable, "-m", "llmrl", "serve-inference", "--model", model, "--port", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            if process.poll() is not None:
                raise RuntimeError(f"the server for {model} exited with {process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"the server for {model} did not start within 120 s")
        yield f"{url}/v1"
    finally:
        process.terminate()
        process.wait(timeout=30)


async def burst(base_url: str, count: int, max_tokens: int) -> tuple[float, list[float], int]:
    """Send `count` chat completions at once; returns (seconds, latencies, failures)."""
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        async def one(index: int) -> float | None:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            body = {
                "messages": [{"role": "user", "content": f"What is {a} + {b}?"}],
                "max_tokens": max_tokens,
                "seed": index,
                "logprobs": True,
            }
            started = time.perf_counter()
            response = await client.post("/chat/completions", json=body)
            if response.status_code != 200 or not response.json()["choices"][0].get("token_ids"):
                return None
            return time.perf_counter() - started

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(count)))
        seconds = time.perf_counter() - started
    latencies = [r for r in results if r is not None]
    return seconds, latencies, count - len(latencies)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_load(requests: int, max_tokens: int) -> None:
    with inference_server("tiny://arithmetic") as base_url:
        asyncio.run(burst(base_url, 8, max_tokens))  # warm-up
        seconds, latencies, failures = asyncio.run(burst(base_url, requests, max_tokens))
    print(f"load: {requests} concurrent chat completions (max_tokens {max_tokens}) on the tiny model")
    print(
        f"  {requests / seconds:.1f} requests/s, p50 {percentile(latencies, 0.5) * 1000:.0f} ms, "
        f"p99 {percentile(latencies, 0.99) * 1000:.0f} ms, failed or incomplete: {failures}"
    )


def random_100m_model(folder: Path) -> Path:
    """A random ~100M-parameter Qwen2 with the tiny model's tokenizer (only its weights matter here)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path("arithmetic")).save_pretrained(folder)
    return folder


def bench_sync(repeats: int) -> None:
    from llmrl.models import load_model

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        models = {"tiny": "tiny://arithmetic", "~100M": str(random_100m_model(scratch / "model-100m"))}
        for name, spec in models.items():
            model, _ = load_model(spec)
            state = model.state_dict()
            parameters = sum(p.numel() for p in model.parameters())
            megabytes = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
            weights_dir = scratch / f"weights-{name}"
            weights_dir.mkdir()
            with inference_server(spec, weights_dir) as base_url:
                for mode, folder in (("file", weights_dir), ("stream", None)):
                    client = OpenAIInterface(base_url, weights_dir=folder)
                    times = []
                    for version in range(1, repeats + 1):
                        started = time.perf_counter()
                        client.update_weights(state, version, reset=True)
                        times.append(time.perf_counter() - started)
                    print(
                        f"sync {name} ({parameters / 1e6:.1f}M parameters, {megabytes:.0f} MiB fp32) "
                        f"by {mode}: best {min(times):.3f} s, median {statistics.median(times):.3f} s"
                    )
            shutil.rmtree(weights_dir)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sync-repeats", type=int, default=3)
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()
    bench_load(args.requests, args.max_tokens)
    bench_sync(args.sync_repeats)


if __name__ == "__main__":
    main()
