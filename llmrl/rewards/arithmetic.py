"""The arithmetic task: seeded problem streams, their split, chat prompts and the exact-answer reward.

The `arithmetic` environment serves it (`llmrl.envs.arithmetic`), and the tiny model is warmed up on
it (`llmrl.models.tiny_build`), which is why the problems live here with their reward and not in the
environment: models sit below environments.

Problems are `a op b` with operands of exactly `digits` digits (0-9 when `digits` is 1). Every
problem belongs to one split for good: it is held out when a hash of its text falls below
`HELDOUT_FRACTION`. The split is a property of the problem, not of a seed or of a sample, so no
caller (the tiny model's warm-up, a GRPO run, an evaluation) can ever train on a held-out problem,
whatever seeds or sizes they pick.

Reward: 1.0 when the first integer in the completion equals the answer, else 0.0.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from llmrl.types import ChatMessage

Op = Literal["+", "*"]
Split = Literal["train", "test"]

OPS: tuple[str, ...] = ("+", "*")
HELDOUT_FRACTION = 0.1
"""Share of all problems in the `test` split. Fixed (not an argument) so that splits never overlap."""

_FIRST_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One problem; `problem_id` is its text without spaces, e.g. ``23+45``."""

    problem_id: str
    a: int
    b: int
    op: Op
    answer: int

    @classmethod
    def of(cls, a: int, op: str, b: int) -> ArithmeticProblem:
        """The problem `a op b` with its id and answer filled in."""
        check_ops((op,))
        answer = a + b if op == "+" else a * b
        return cls(problem_id=f"{a}{op}{b}", a=a, b=b, op=op, answer=answer)  # type: ignore[arg-type]

    @property
    def split(self) -> Split:
        """`test` for held-out problems, `train` for the rest."""
        digest = hashlib.blake2b(self.problem_id.encode(), digest_size=8).digest()
        return "test" if int.from_bytes(digest, "big") < HELDOUT_FRACTION * 2**64 else "train"


def check_ops(ops: Sequence[str]) -> None:
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"ops must be a non-empty selection of {list(OPS)}, got {list(ops)!r}")


def operand_range(digits: int) -> range:
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 9:
        raise ValueError(f"digits must be an integer from 1 to 9, got {digits!r}")
    return range(0, 10) if digits == 1 else range(10 ** (digits - 1), 10**digits)


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


def iter_problems(
    *, digits: int = 2, ops: Sequence[str] = ("+",), split: Split = "train", seed: int = 0
) -> Iterator[ArithmeticProblem]:
    """An endless seeded stream of problems from one split, drawn uniformly (repeats happen)."""
    operands = operand_range(digits)
    check_ops(ops)
    _check_split(split)
    rng = random.Random(seed)
    while True:
        # Rejection sampling keeps the draw uniform over the split without enumerating it.
        problem = ArithmeticProblem.of(rng.choice(operands), rng.choice(ops), rng.choice(operands))
        if problem.split == split:
            yield problem


def sample_problems(
    count: int, *, digits: int = 2, ops: Sequence[str] = ("+",), split: Split = "test", seed: int = 0
) -> list[ArithmeticProblem]:
    """`count` distinct problems from one split, in seeded random order (an evaluation set)."""
    operands = operand_range(digits)
    check_ops(ops)
    _check_split(split)
    share = HELDOUT_FRACTION if split == "test" else 1 - HELDOUT_FRACTION
    # Half the split's expected size: enough headroom that drawing distinct problems stays quick.
    most = int(len(operands) ** 2 * len(set(ops)) * share) // 2
    if not 0 <= count <= most:
        raise ValueError(
            f"count must be between 0 and {most} for digits={digits}, ops={list(ops)}, split={split!r}; got {count}"
        )
    chosen: dict[str, ArithmeticProblem] = {}
    stream = iter_problems(digits=digits, ops=ops, split=split, seed=seed)
    while len(chosen) < count:
        problem = next(stream)
        chosen.setdefault(problem.problem_id, problem)
    return list(chosen.values())


def prompt_text(problem: ArithmeticProblem) -> str:
    """The question as the user asks it, e.g. ``What is 23 + 45?``."""
    return f"What is {problem.a} {problem.op} {problem.b}?"


def prompt_messages(problem: ArithmeticProblem) -> list[ChatMessage]:
    """The chat prompt: a single user turn, no system prompt (the tiny model is trained on exactly this)."""
    return [ChatMessage(role="user", content=prompt_text(problem))]


def first_integer(completion: str) -> int | None:
    """The first integer in `completion` (the answer the tiny model gives), or None."""
    match = _FIRST_INTEGER.search(completion)
    return None if match is None else int(match.group())


def score(completion: str, problem: ArithmeticProblem) -> float:
    """1.0 if the first integer in `completion` equals the answer, else 0.0."""
    return 1.0 if first_integer(completion) == problem.answer else 0.0
