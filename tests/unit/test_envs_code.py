"""code: the reward table on hand-written completions, run in the sandbox; the shipped MBPP-format fixture."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmrl.agents.base import Problem
from llmrl.agents.dataset import packaged_data
from llmrl.envs.code import CodeAgent, extract_code
from llmrl.types import InferenceResponse

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
PROBLEM = Problem("add", "Write add(a, b).", {"tests": TESTS, "setup": ""})


@pytest.fixture(scope="module")
def agent():
    return CodeAgent(timeout_s=1.0)


def respond(text, finish_reason="stop"):
    return InferenceResponse(text=text, prompt_token_ids=[1], token_ids=[2], finish_reason=finish_reason)


def fenced(code):
    return f"Here you go:\n```python\n{code}\n```\nDone."


@pytest.mark.parametrize(
    "completion, reward",
    [
        (fenced("def add(a, b):\n    return a + b"), 1.0),
        ("def add(a, b):\n    return a + b", 1.0),  # no fence: the whole completion is the code
        ("```python\ndef add(a, b):\n    return a + b", 1.0),  # unclosed fence (truncated answer)
        (
            fenced("def add(a, b):\n    return 0") + "\n" + fenced("def add(a, b):\n    return a + b"),
            1.0,
        ),  # last block
        (fenced("def add(a, b):\n    return a + b if a != 10 else 0"), 2 / 3),
        (fenced("def add(a, b):\n    return a * b"), 0.0),
        (fenced("def add(a, b) return a + b"), 0.0),  # syntax error
        (fenced("import sys\nsys.exit(0)"), 0.0),  # exiting early does not pass the tests
        (fenced("import os\nos._exit(0)"), 0.0),
        (
            fenced("print('\\n0000 0 pass\\n0000 1 pass\\n0000 2 pass')"),
            0.0,
        ),  # printed text never reaches the report
        (
            fenced("def add(a, b):\n    while a == 10:\n        pass\n    return a + b"),
            2 / 3,
        ),  # passed before the timeout
        ("I don't know.", 0.0),
    ],
)
def test_reward_table(agent, completion, reward):
    assert agent.reward(respond(completion), PROBLEM) == pytest.approx(reward)


def test_all_or_nothing_mode():
    strict = CodeAgent(reward_mode="all", timeout_s=1.0)
    assert (
        strict.reward(respond(fenced("def add(a, b):\n    return a + b if a != 10 else 0")), PROBLEM) == 0.0
    )
    assert strict.reward(respond(fenced("def add(a, b):\n    return a + b")), PROBLEM) == 1.0


def test_humaneval_style_test_code_and_setup(agent):
    check = "def check(candidate):\n    assert candidate('ab') == 'ba'\n    assert candidate('') == ''\ncheck(reverse)"
    problem = Problem("rev", "def reverse(s):", {"tests": [check], "setup": "import string"})
    assert agent.reward(respond(fenced("def reverse(s):\n    return s[::-1]")), problem) == 1.0
    assert agent.reward(respond(fenced("def reverse(s):\n    return s")), problem) == 0.0
    uses_setup = Problem(
        "up", "upper", {"tests": ["assert f() == string.ascii_uppercase[0]"], "setup": "import string"}
    )
    assert agent.reward(respond("def f():\n    return 'A'"), uses_setup) == 1.0


def test_extract_code_variants():
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"
    assert extract_code("```\nx = 2\n```") == "x = 2\n"
    assert extract_code("plain text") == "plain text"


def test_fixture_reference_solutions_pass_and_prompts_show_the_tests(agent):
    assert len(agent.train_problems) == 20 and len(agent.eval_problems) == 10
    first = agent.train_problems[0]
    assert (
        first.prompt[-1].content.startswith("Write a function")
        and first.answer["tests"][0] in first.prompt[-1].content
    )
    rows = []
    for name in ("mbpp_train.jsonl", "mbpp_test.jsonl"):
        with open(packaged_data(name)) as f:
            rows += [json.loads(line) for line in f]
    problems = [Problem(str(r["task_id"]), r["text"], {"tests": r["test_list"], "setup": ""}) for r in rows]
    with ThreadPoolExecutor(4) as pool:  # as the agent runs rewards: in threads, sandboxes in parallel
        rewards = list(
            pool.map(
                lambda p_r: agent.reward(respond(fenced(p_r[1]["code"])), p_r[0]),
                zip(problems, rows, strict=True),
            )
        )
    assert rewards == [1.0] * 30
    wrong = agent.reward(respond(fenced(rows[0]["code"].replace("n * n", "n + n"))), problems[0])
    assert wrong < 1.0


def test_configuration_errors():
    with pytest.raises(ValueError, match="reward_mode must be"):
        CodeAgent(reward_mode="most")
    with pytest.raises(ValueError, match="memory_mb must be >= 64"):
        CodeAgent(memory_mb=1)
    with pytest.raises(
        ValueError, match=r"mbpp_train.jsonl: setup_column='setup': not a column.*'test_setup_code'"
    ):
        CodeAgent(setup_column="setup")
