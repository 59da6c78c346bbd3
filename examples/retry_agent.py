"""An agent program written only against the `openai` package: ask a sum, and ask again when wrong.

llmrl trains it as it is (examples/arithmetic_retry_agent.yaml); pointed at any OpenAI-compatible
server, it runs the same. Up to three calls per problem: after a wrong answer the program says so
and asks the question again, in the same conversation. Reward 1 when the last answer is right.
"""

from __future__ import annotations

import re

import openai

MAX_CALLS = 3


def first_integer(text: str) -> int | None:
    match = re.search(r"-?\d+", text)
    return None if match is None else int(match.group())


async def rollout(client: openai.AsyncOpenAI, problem: dict) -> dict:
    messages = [{"role": "user", "content": problem["question"]}]
    for call in range(1, MAX_CALLS + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        answer = reply.choices[0].message.content or ""
        right = first_integer(answer) == problem["answer"]
        if right or call == MAX_CALLS:
            break
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"No, that is wrong. {problem['question']}"},
        ]
    return {"reward": float(right), "calls": float(call), "first_try": float(right and call == 1)}
