"""Writes the example data in TRL's and verl's layouts from llmrl's own small MATH and GSM8K fixtures
(llmrl/data), so the examples run offline. Run from the repository root:
``python examples/data/write_data.py``. For real training, point the examples at the real files.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmrl.agents.dataset import load_rows, packaged_data
from llmrl.rewards.answers import after_hashes, last_boxed
from llmrl.rewards.arithmetic import prompt_text, sample_problems

HERE = Path(__file__).parent
DAPO_INSTRUCTION = (
    'Solve the problem below step by step. End your response with a line of the form "Answer: X", '
    "where X is the final answer.\n\n{problem}"
)


def math_dapo_rows(split: str) -> list[dict]:
    """MATH-style problems in verl's layout, scored as DAPO-Math-17k is (`data_source: math_dapo`)."""
    rows = load_rows(data_files=packaged_data(f"math_{split}.jsonl"))
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": DAPO_INSTRUCTION.format(problem=row["problem"])}],
            "ability": "MATH",
            "reward_model": {
                "style": "rule-lighteval/MATH_v2",
                "ground_truth": last_boxed(row["solution"])[0],
            },
            "extra_info": {"index": f"{split}-{i}", "type": row["type"]},
        }
        for i, row in enumerate(rows)
    ]


def word_problem_rows(split: str) -> list[dict]:
    """GSM8K-style problems in TRL's conversational layout, the final number as `solution`."""
    rows = load_rows(data_files=packaged_data(f"gsm8k_{split}.jsonl"))
    return [
        {"prompt": [{"role": "user", "content": row["question"]}], "solution": after_hashes(row["answer"])[0]}
        for row in rows
    ]


def sum_rows(split: str) -> list[dict]:
    """Two-digit sums from the arithmetic task's own split, for the retry agent program (the tiny
    model is warmed up on exactly this question)."""
    count = 2000 if split == "train" else 128
    problems = sample_problems(count, digits=2, ops=("+",), split=split, seed=0)
    return [{"id": p.problem_id, "question": prompt_text(p), "answer": p.answer} for p in problems]


def write() -> None:
    import pandas

    for split in ("train", "test"):
        pandas.DataFrame(math_dapo_rows(split)).to_parquet(HERE / f"math_dapo_{split}.parquet", index=False)
        for name, rows in (("word_problems", word_problem_rows(split)), ("sums", sum_rows(split))):
            with open(HERE / f"{name}_{split}.jsonl", "w") as file:
                file.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    write()
