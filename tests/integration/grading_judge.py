"""A judge server for tests: an OpenAI-compatible chat endpoint that grades as a perfect grader of
sums would, reading llmrl's default judge template. ``python -m tests.integration.grading_judge --port P``.

CORRECT when the response's first number is the reference answer (as the fixtures' `correct_sum`
scores), else INCORRECT; each answer after `--delay-s`, as a judge behind an API takes its time."""

from __future__ import annotations

import argparse
import asyncio
import re

import uvicorn
from fastapi import FastAPI

GRADED = re.compile(r"Reference answer:\n(.*)\n\nResponse:\n(.*)\n\nDoes", re.DOTALL)


def create_app(delay_s: float) -> FastAPI:
    app = FastAPI()

    @app.get("/healthz")
    async def health() -> dict:
        return {"ok": True}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "grader"}]}

    @app.post("/v1/chat/completions")
    async def grade(body: dict) -> dict:
        await asyncio.sleep(delay_s)
        reference, response = GRADED.search(body["messages"][-1]["content"]).groups()
        first = re.search(r"-?\d+", response)
        verdict = "CORRECT" if first is not None and first.group() == reference.strip() else "INCORRECT"
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": verdict}}]}

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args()
    uvicorn.run(create_app(args.delay_s), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
