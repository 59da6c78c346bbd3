"""A small scripted InferenceInterface for agent tests (deterministic, instant, inspectable), and a toy agent.

Text is tokenised one character per token. Completion tokens use ids offset by `COMPLETION_OFFSET`,
so they decode to the same characters as prompt tokens but differ from what re-tokenising their
text would give: a trajectory that re-tokenised an earlier turn would not match `token_ids`.
Chat messages are rendered as ``<role>content\\n`` and end with ``<assistant>``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from llmrl.agents import Problem, RewardOnlyAgent, make_prompt
from llmrl.inference.interface import Health, run_sync
from llmrl.types import ChatMessage, InferenceRequest, InferenceResponse

COMPLETION_OFFSET = 100_000


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i % COMPLETION_OFFSET) for i in ids)


def render(prompt: str | list[ChatMessage]) -> str:
    if isinstance(prompt, str):
        return prompt
    return "".join(f"<{m.role}>{m.content}\n" for m in prompt) + "<assistant>"


def logprob(position: int) -> float:
    """The fake logprob of the completion token at `position`."""
    return -0.125 * (position % 5 + 1)


class ScriptedInference:
    """Completions come from `reply(prompt_text, sample_index)`; exceptions it raises are inference
    failures."""

    def __init__(
        self,
        reply: Callable[[str, int], str] | str,
        *,
        delay_s: Callable[[str], float] | float = 0.0,
        policy_version: int = 0,
    ):
        self.reply = reply if callable(reply) else (lambda prompt, index: reply)
        self.delay_s = delay_s if callable(delay_s) else (lambda prompt: delay_s)
        self.policy_version = policy_version
        self.requests: list[InferenceRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def agenerate(self, request: InferenceRequest) -> list[InferenceResponse]:
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            prompt_ids = list(request.prompt_token_ids or []) + encode(render(request.prompt))
            prompt = decode(prompt_ids)
            await asyncio.sleep(self.delay_s(prompt))  # also lets concurrent requests overlap
            return [self._complete(prompt_ids, prompt, i, request) for i in range(request.n)]
        finally:
            self.in_flight -= 1

    def _complete(
        self, prompt_ids: list[int], prompt: str, index: int, request: InferenceRequest
    ) -> InferenceResponse:
        text = self.reply(prompt, index)
        max_tokens = request.generation_args.max_tokens
        finish_reason = "length" if len(text) > max_tokens else "stop"
        text = text[:max_tokens]
        ids = [ord(c) + COMPLETION_OFFSET for c in text]
        return InferenceResponse(
            text=text,
            prompt_token_ids=prompt_ids,
            token_ids=ids,
            logprobs=[logprob(i) for i in range(len(ids))],
            finish_reason=finish_reason,
            policy_version=self.policy_version,
        )

    def generate(self, request: InferenceRequest) -> list[InferenceResponse]:
        return run_sync(self.agenerate(request))

    def weight_transport(self, kind: str) -> ScriptedInference:
        return self  # takes any payload, and only records its version

    def send(self, payload: Any, version: int, *, reset: bool = False) -> None:
        payload.drain()
        self.policy_version = version

    def health(self) -> Health:
        return Health()

    def close(self) -> None:
        pass


class EchoAgent(RewardOnlyAgent):
    """Problem i asks for the answer 'a{i}'; reward 1 when the completion is exactly that."""

    def __init__(self, num_problems=20, chat=False, **kwargs):
        super().__init__(**kwargs)
        self.num_problems = num_problems
        self.chat = chat

    def prompts(self):
        return [
            Problem(f"p{i}", make_prompt(f"say a{i}", chat=self.chat), answer=f"a{i}")
            for i in range(self.num_problems)
        ]

    def reward(self, response: InferenceResponse, problem: Problem) -> float:
        return float(response.text == problem.answer)


def answer_of(prompt: str) -> str:
    """The right reply to the last 'say aN' in a scripted prompt."""
    return "a" + prompt.rsplit("say a", 1)[1].split("\n")[0]
