"""Final-answer conventions of math and QA data: where a completion marks its answer, and when two
answers are the same text.

A completion marks its final answer as ``\\boxed{...}`` (MATH), ``<answer>...</answer>`` (R1-style
prompts) or after ``####`` (GSM8K); each extractor returns the content and the index just after it,
so that callers can also look at what follows the answer. Two answers are the same when
`math-verify` (Hugging Face) parses both as LaTeX and finds them symbolically equal.

math-verify's own timeouts use SIGALRM, which only works in the main thread; rewards run in worker
threads under the agent's `reward_timeout_s`, so they are turned off here.
"""

from __future__ import annotations

import functools
import re


def last_boxed(text: str) -> tuple[str, int] | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed) and the index just after it."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : i].strip(), i + 1
    return None


def last_tagged(text: str, tag: str = "answer") -> tuple[str, int] | None:
    """Content of the last ``<tag>...</tag>`` and the index just after it."""
    matches = list(re.finditer(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL))
    if not matches:
        return None
    return matches[-1].group(1).strip(), matches[-1].end()


def after_hashes(text: str) -> tuple[str, int] | None:
    """GSM8K's final answer: what follows the last ``####`` on its line."""
    matches = list(re.finditer(r"####[ \t]*([^\n]*)", text))
    if not matches or not matches[-1].group(1).strip():
        return None
    return matches[-1].group(1).strip(), matches[-1].end()


def extract_answer(text: str) -> tuple[str, int] | None:
    """The marked final answer and where it ends: ``\\boxed{}``, then ``<answer>`` tags, then ``####``."""
    return last_boxed(text) or last_tagged(text) or after_hashes(text)


def normalize_answer(answer: str) -> str:
    """Case, surrounding space and punctuation, thousands separators and numeric form ignored."""
    text = " ".join(answer.strip().strip(".").strip("$").lower().split())
    number = text.replace(",", "")
    try:
        value = float(number)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else repr(value)


@functools.lru_cache(maxsize=65536)
def _parse(answer: str) -> tuple:
    from math_verify import parse  # deferred: math-verify pulls in sympy (about a second)

    latex = answer if "$" in answer else f"${answer}$"
    return tuple(parse(latex, parsing_timeout=None))


def is_equivalent(reference: str, answer: str) -> bool:
    """True when `answer` is mathematically the same as `reference` (string match if either won't parse)."""
    from math_verify import verify

    gold, guess = _parse(reference), _parse(answer)
    if not gold or not guess:
        return normalize_answer(reference) == normalize_answer(answer)
    return verify(list(gold), list(guess), timeout_seconds=None)


def math_reward(
    text: str,
    reference: str,
    *,
    truncated: bool = False,
    truncation_penalty: float = 0.0,
    trailing_penalty: float = 0.0,
) -> float:
    """1 for a correct marked answer, else 0, minus the truncation or trailing-text penalty."""
    marked = extract_answer(text)
    reward = float(marked is not None and is_equivalent(reference, marked[0]))
    if truncated:
        reward -= truncation_penalty
    elif marked is not None and text[marked[1] :].strip():
        reward -= trailing_penalty
    return reward
