"""The agent program in docs/agents.md runs as written: its tool and answer helpers are defined, and
an episode with a tool call reaches the reward."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def program() -> dict:
    (source,) = re.findall(
        r"```python\n(# my_agents\.py\n.*?)```", (ROOT / "docs" / "agents.md").read_text(), re.S
    )
    namespace: dict = {}
    exec(compile(source, "docs/agents.md", "exec"), namespace)
    return namespace


class ScriptedClient:
    """An `openai.AsyncOpenAI` stand-in whose replies are given in order; it keeps the requests."""

    def __init__(self, *replies: SimpleNamespace):
        self.replies = list(replies)
        self.requests: list[dict] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **request):
        self.requests.append({**request, "messages": list(request["messages"])})
        return SimpleNamespace(choices=[SimpleNamespace(message=self.replies.pop(0))])


def test_the_calculator_takes_arithmetic_only():
    calculate = program()["calculate"]
    assert calculate("(12 + 30) * 2 - -1") == "85"
    assert calculate("7 / 2") == "3.5"
    assert calculate("1 / 0") == "error: division by zero"
    assert calculate("__import__('os').getcwd()").startswith("error: only numbers")


def test_an_episode_calls_the_tool_and_scores_the_final_number():
    solve = program()["solve"]
    call = SimpleNamespace(
        id="call-1", function=SimpleNamespace(arguments=json.dumps({"expression": "47 + 12"}))
    )
    client = ScriptedClient(
        SimpleNamespace(content="", tool_calls=[call]),
        SimpleNamespace(content="The sum is 59.", tool_calls=None),
    )
    result = asyncio.run(solve(client, {"question": "What is 47 + 12?", "answer": 59}))
    assert result == {"reward": 1.0, "calls": 2}
    assert client.requests[1]["messages"][-1] == {"role": "tool", "tool_call_id": "call-1", "content": "59"}
