"""A run whose LLM judge is a model llmrl serves: the tiny model, started by the run as its own
`llmrl serve-inference` process, asked to add the reference answer and the completion. A reward that
means nothing, but every part is the real one: the server the judge entry starts, the template filled
with a data column and the completion, the score parser, the cache and the counts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.integration.short_runs import STEPS, failures, short_run

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "layouts"


def test_a_run_graded_by_a_judge_it_serves(tmp_path, tiny_model_path):
    judge = {
        "serve": {"model": "tiny://arithmetic"},
        "template": "What is {solution} + {completion}?",
        "parser": "score",
        "max_tokens": 6,
    }
    environment = {
        "agent_type": "dataset",
        "env_id": "judged",
        "agent_args": {
            "data_files": str(FIXTURES / "trl_train.jsonl"),
            "eval_data_files": str(FIXTURES / "trl_test.jsonl"),
            "answer_column": "solution",
            "reward_functions": [{"judge": judge}],
        },
    }
    _, rows = short_run(tmp_path, environment, generation={"max_tokens": 16})
    assert len(rows) == STEPS
    for row in rows:
        assert math.isfinite(row["reward/judged/judge"])
        assert not failures(row, "judged")
        # Each completion graded once: asked, or answered from the cache (a repeated reply to a prompt).
        assert row["agents/judged/judge/requests"] + row["agents/judged/judge/cache_hits"] == 8 * 4
        assert row["agents/judged/judge/requests"] > 0
