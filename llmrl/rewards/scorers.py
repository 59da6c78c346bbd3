"""verl-style scorers: ``score(data_source, solution_str, ground_truth, extra_info=None) -> float``.

`default_compute_score` picks the scorer from the row's ``data_source``, as verl's function of the
same name does, so a parquet file written by verl's preprocessing scripts trains without reward code:

==============================================================  =====================================
data_source                                                     scorer
==============================================================  =====================================
``openai/gsm8k``                                                `gsm8k_strict`: the last ``#### n``
``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,      `math_boxed`: the last ``\\boxed{}``,
``HuggingFaceH4/MATH-500``                                      equivalent by math-verify
``math_dapo``, ``aime*``                                        `math_dapo`: the last ``Answer: X``
                                                                line, DAPO's normalisation
``arithmetic``, ``gsm8k``, ``math``, ``countdown``              llmrl's own environments' rewards
==============================================================  =====================================

Every scorer gives 1.0 for a correct answer and 0.0 otherwise. (verl's DAPO scorer gives -1.0 for a
wrong answer; GRPO's normalised advantages are the same either way, since they do not change when
all rewards are shifted and scaled alike.) An unknown data source is a `ValueError` naming it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from llmrl.rewards.answers import after_hashes, is_equivalent, last_boxed, math_reward, normalize_answer
from llmrl.rewards.arithmetic import first_integer
from llmrl.rewards.countdown import countdown_reward

# ---- GSM8K ------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?[0-9][0-9.,]*")


def gsm8k_strict(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the number after the completion's last ``####`` equals the ground truth (GSM8K's format)."""
    del data_source, extra_info
    marked = after_hashes(solution_str)
    return float(marked is not None and _same_number(marked[0], ground_truth))


def gsm8k_flexible(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the completion's last number equals the ground truth, wherever it stands."""
    del data_source, extra_info
    numbers = _NUMBER.findall(solution_str)
    return float(bool(numbers) and _same_number(numbers[-1].rstrip(".,"), ground_truth))


def _same_number(answer: str, ground_truth: Any) -> bool:
    """Equal after dropping dollar signs, thousands separators and trailing zeros (``1,000.0`` = ``1000``)."""
    return normalize_answer(answer.replace("$", "")) == normalize_answer(str(ground_truth).replace("$", ""))


# ---- MATH -------------------------------------------------------------------------------------


def math_boxed(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the completion's last ``\\boxed{}`` is mathematically equal to the ground truth (math-verify).

    A ground truth that is itself a worked solution is reduced to its own boxed answer first.
    """
    del data_source, extra_info
    boxed = last_boxed(solution_str)
    if boxed is None:
        return 0.0
    reference = str(ground_truth)
    reference = (last_boxed(reference) or (reference,))[0]
    return float(is_equivalent(reference, boxed[0]))


# ---- DAPO -------------------------------------------------------------------------------------
# DAPO (Yu et al. 2025) scores the last "Answer: X" line, compared after the normalisation of
# Minerva (Lewkowycz et al. 2022, appendix D.1; as in lm-evaluation-harness' hendrycks_math).

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# Text replaced, in this order, then unit words and decorations dropped.
_REPLACED = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_DROPPED = (
    "square ways integers dollars mph inches hours km units \\ldots sue points feet minutes digits cents "
    "degrees cm gm pounds meters meals edges students childrentickets multiples \\text{s} \\text{.} "
    '\\text{\ns} \\text{}^2 \\text{}^3 \\text{\n} \\text{} \\mathrm{th} ^\\circ ^{\\circ} \\; ,\\! {,} " \\dots'
).split(" ")
# Each pattern keeps the group in its replacement: math between dollars, and the argument of
# \text, \textbf, \overline and \boxed.
_UNWRAPPED = (
    (r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"),
    (r"(\\text\{)(.*?)(\})", "\\2"),
    (r"(\\textbf\{)(.*?)(\})", "\\2"),
    (r"(\\overline\{)(.*?)(\})", "\\2"),
    (r"(\\boxed\{)(.*)(\})", "\\2"),
)
# TeX shorthand: \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}.
_SHORTHAND = ((r"(frac)([^{])(.)", "frac{\\2}{\\3}"), (r"(sqrt)([^{])", "sqrt{\\2}"))


def normalize_dapo_answer(answer: str) -> str:
    """DAPO's (Minerva's) normal form of a final answer: what follows the last ``=``, without spaces,
    units, ``\\text{}``-style wrappers and dollar signs; digits with thousands separators as a plain
    number."""
    answer = answer.split("=")[-1]
    for before, after in _REPLACED:
        answer = answer.replace(before, after)
    for dropped in _DROPPED:
        answer = answer.replace(dropped, "")
    for pattern, replacement in (*_UNWRAPPED, *_SHORTHAND):
        answer = re.sub(pattern, replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def math_dapo(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the completion's last ``Answer: X`` line equals the ground truth after
    `normalize_dapo_answer`."""
    del data_source, extra_info
    lines = _ANSWER_LINE.findall(solution_str)
    if not lines:
        return 0.0
    return float(normalize_dapo_answer(lines[-1]) == normalize_dapo_answer(str(ground_truth)))


# ---- llmrl's environments ---------------------------------------------------------------------


def _arithmetic(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return float(first_integer(solution_str) == int(ground_truth))


def _marked_math(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return math_reward(solution_str, str(ground_truth))


def _countdown(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    if not isinstance(ground_truth, dict) or not {"numbers", "target"} <= set(ground_truth):
        raise ValueError(
            f"countdown: ground_truth must be a mapping with numbers and target, got {ground_truth!r}"
        )
    return countdown_reward(solution_str, tuple(ground_truth["numbers"]), int(ground_truth["target"]))


Scorer = Callable[..., float]

_BY_DATA_SOURCE: dict[str, Scorer] = {
    "openai/gsm8k": gsm8k_strict,
    "lighteval/MATH": math_boxed,
    "DigitalLearningGmbH/MATH-lighteval": math_boxed,
    "HuggingFaceH4/MATH-500": math_boxed,
    "math_dapo": math_dapo,
    "arithmetic": _arithmetic,
    "gsm8k": _marked_math,
    "math": _marked_math,
    "countdown": _countdown,
}


def scorer_for(data_source: str) -> Scorer:
    """The scorer `default_compute_score` uses for `data_source`; a ValueError lists the known sources."""
    if data_source in _BY_DATA_SOURCE:
        return _BY_DATA_SOURCE[data_source]
    if str(data_source).startswith("aime"):
        return math_dapo
    known = ", ".join([*_BY_DATA_SOURCE, "aime*"])
    raise ValueError(
        f"no built-in scorer for data_source {data_source!r}; known: {known}. "
        "Give the environment reward_functions for other data"
    )


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float:
    """The score of `solution_str` by the scorer of its `data_source` (see the module docstring)."""
    return scorer_for(data_source)(data_source, solution_str, ground_truth, extra_info)
