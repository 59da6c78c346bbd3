"""A verifiers environment (prime-rl's library), written only against `verifiers`: ask a sum, and ask
again when the answer is wrong.

llmrl trains it as it is (examples/verifiers_env.yaml, `agent_type: verifiers`); `vf-eval` or any other
verifiers runner runs the same environment. A `vf.MultiTurnEnv` over the sums of examples/data: after a
wrong answer the environment says so and the model answers again, in the same conversation, up to
`max_turns` answers. Its `vf.Rubric` scores the last answer (1 when right); `first_try` is a metric
(weight 0), logged beside the reward.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import verifiers as vf
from datasets import Dataset

DATA = Path(__file__).parent / "data"


def sums(split: str) -> Dataset:
    """The sums of examples/data/sums_{split}.jsonl as verifiers reads a dataset: question and answer."""
    with open(DATA / f"sums_{split}.jsonl", encoding="utf-8") as file:
        rows = [json.loads(line) for line in file]
    return Dataset.from_list([{"question": r["question"], "answer": str(r["answer"])} for r in rows])


def first_integer(text: str | None) -> str | None:
    match = re.search(r"-?\d+", text or "")
    return None if match is None else match.group()


class RetrySums(vf.MultiTurnEnv):
    """Ends when the model answers right; otherwise tells it so and lets it answer again."""

    @vf.stop
    async def answered_right(self, state: vf.State) -> bool:
        if not state["trajectory"]:
            return False
        answer = self.parser.parse_answer(state["trajectory"][-1]["completion"])
        return answer == state["answer"]

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        return [vf.UserMessage(content="No, that is wrong. Try again.")]


def correct_answer(parser: vf.Parser, completion: vf.Messages, answer: str) -> float:
    return float(parser.parse_answer(completion) == answer)


def first_try(parser: vf.Parser, completion: vf.Messages, answer: str) -> float:
    replies = parser.get_assistant_messages(completion)
    return float(bool(replies) and parser.parse_answer(replies[:1]) == answer)


def load_environment(max_turns: int = 3, max_tokens: int = 8) -> vf.Environment:
    parser = vf.Parser(extract_fn=first_integer)
    rubric = vf.Rubric(funcs=[correct_answer, first_try], weights=[1.0, 0.0], parser=parser)
    return RetrySums(
        dataset=sums("train"),
        eval_dataset=sums("test"),
        parser=parser,
        rubric=rubric,
        max_turns=max_turns,
        sampling_args={"max_tokens": max_tokens},
    )
