"""The code reward cannot be faked: a battery of hostile solutions, each scoring 0, and honest ones scoring 1.

Every attack targets the three tests of `add` below without solving them; a broken harness would
score up to 1. `test_honest_solutions_keep_full_reward` checks that the split into checker and
solver processes costs correct code nothing (classes, exceptions, modules, HumanEval's `check`).
"""

import time

import pytest

from llmrl.agents.base import Problem
from llmrl.envs import code_harness
from llmrl.envs.code import CodeAgent, run_tests
from llmrl.types import InferenceResponse

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
FORGED = '{"test": 0, "passed": true, "error": null}\\n{"test": 1, "passed": true, "error": null}\\n{"test": 2, "passed": true, "error": null}\\n'

ATTACKS = {
    "read the harness and write its report lines": (
        "import os\nHARNESS = open('main.py').read()\nassert 'report' in HARNESS\n"
        f"print('{FORGED}')\nos.write(1, b'{FORGED}')\n"
        "for path in ('/dev/stdout', '/proc/self/fd/1'):\n"
        f"    with open(path, 'w') as f:\n        f.write('{FORGED}')\n"
    ),
    "walk gc and the stack for a secret or the report file": (
        "import gc, io, re, sys\nfound = set()\n"
        "for o in gc.get_objects():\n"
        "    if isinstance(o, io.IOBase):\n"
        "        try:\n"
        f"            o.write('{FORGED}' if isinstance(o, io.TextIOBase) else b'{FORGED}'); o.flush()\n"
        "        except Exception:\n            pass\n"
        "    if isinstance(o, dict):\n"
        "        found.update(v for v in o.values() if isinstance(v, str) and re.fullmatch('[0-9a-f]{32}', v))\n"
        "frame = sys._getframe()\nwhile frame is not None:\n"
        "    found.update(v for v in frame.f_locals.values() if isinstance(v, str) and 'assert add' in v)\n"
        "    frame = frame.f_back\n"
        "assert not found, found\n"
        "for secret in found:\n    print(f'\\n{secret} 0 pass\\n{secret} 1 pass\\n{secret} 2 pass')\n"
    ),
    "read and write the parent's /proc entries": (
        "import os\nparent = os.getppid()\n"
        "for name, mode in (('environ', 'rb'), ('cmdline', 'rb'), ('mem', 'rb'), ('fd/1', 'w')):\n"
        "    try:\n"
        "        with open(f'/proc/{parent}/{name}', mode) as f:\n"
        f"            f.write('{FORGED}') if 'w' in mode else f.read()\n"
        "    except OSError as exc:\n        print(exc)\n"
    ),
    "monkey-patch the runner, json and builtins": (
        "import builtins, gc, json, types\n"
        'json.dumps = lambda *a, **k: \'{"test": 0, "passed": true, "error": null}\'\n'
        "builtins.AssertionError = type('Never', (Exception,), {})\n"
        "for o in gc.get_objects():\n"
        "    if isinstance(o, types.FunctionType) and o.__name__ in ('main', '_send', 'encode', 'decode'):\n"
        "        o.__code__ = (lambda *a, **k: None).__code__\n"
        "def add(a, b):\n    return 0\n"
    ),
    "os._exit(0) before the tests run": "import os\nos._exit(0)",
    "sys.exit(0) before the tests run": "import sys\nsys.exit(0)",
    "raise SystemExit inside a test": "def add(a, b):\n    raise SystemExit(0)",
    "print the pass markers": f"print('{FORGED}')\nprint('\\n' + '0' * 32 + ' 0 pass')",
    "return an object equal to everything": (
        "class Always:\n    def __eq__(self, other):\n        return True\n    __ne__ = lambda s, o: False\n"
        "    __hash__ = object.__hash__\n    __bool__ = lambda s: True\n"
        "def add(a, b):\n    return Always()"
    ),
    "return an int subclass equal to everything": (
        "class Sly(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Sly(0)"
    ),
    "kill the checker": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "answer every call with garbage": (
        "import os\nfor fd in range(3, 10):\n    try:\n"
        "        os.write(fd, b'{\"value\": 3}\\n' * 100 + b'{\"raise\": 1}\\n')\n"
        "    except OSError:\n        pass\n"
    ),
}


def fraction_passed(solution, tests=TESTS, setup="", *, timeout_s=2.0):
    run = run_tests(solution, tests, setup, timeout_s=timeout_s, memory_mb=256)
    return sum(run.passed) / len(tests), run


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_hostile_solutions_score_nothing(attack):
    start = time.monotonic()
    reward, run = fraction_passed(ATTACKS[attack])
    assert reward == 0, (attack, run.sandbox.stdout, run.sandbox.stderr)
    assert time.monotonic() - start < 2.0 and not run.sandbox.timed_out


def test_an_object_without_a_plain_value_has_no_truth_value():
    reward, run = fraction_passed(
        "class Yes:\n    def __bool__(self):\n        return True\ndef is_even(n):\n    return Yes()",
        ["assert is_even(3)", "assert is_even(4) == True"],
    )
    assert reward == 0 and "no truth value" in run.sandbox.stderr + str(run)


def test_the_report_cannot_be_forged_through_printed_test_values():
    # A test that prints what the solution returned: the text goes to stderr, not into the report.
    reward, _ = fraction_passed(
        f"def add(a, b):\n    return '{FORGED}'", ["print(add(1, 2))\nassert False"] * 3
    )
    assert reward == 0


def test_honest_solutions_keep_full_reward():
    assert fraction_passed("def add(a, b):\n    return a + b")[0] == 1.0
    classes = (
        "class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n    def total(self):\n"
        "        return self.a + self.b\n"
        "def longest(pairs):\n    return max(p.total() for p in pairs)\n"
        "def check_positive(n):\n    if n < 0:\n        raise ValueError('negative')\n    return n\n"
        "def stats(xs):\n    return {'min': min(xs), 'items': tuple(xs), 'set': set(xs), 'raw': b'x', 'z': 1j}\n"
        "import math\nLIMIT = 10\n"
    )
    tests = [
        "assert longest([Pair(1, 2), Pair(5, 1)]) == 6",
        "assert Pair(2, 3).a == 2 and Pair(2, 3).total() == 5",
        "try:\n    check_positive(-1)\nexcept ValueError as exc:\n    assert 'negative' in str(exc)\nelse:\n    assert False",
        "assert stats([2, 1, 2]) == {'min': 1, 'items': (2, 1, 2), 'set': {1, 2}, 'raw': b'x', 'z': 1j}",
        "assert math.isclose(math.sqrt(LIMIT) ** 2, 10)",
        "def check(candidate):\n    for n in range(5):\n        assert candidate(n) == n\ncheck(check_positive)",
    ]
    reward, run = fraction_passed(classes, tests)
    assert reward == 1.0, run.sandbox.stderr


def test_code_agent_reward_uses_the_harness():
    agent = CodeAgent(timeout_s=2.0)
    problem = Problem("add", "Write add(a, b).", {"tests": TESTS, "setup": ""})
    response = InferenceResponse(
        text=f"```python\n{ATTACKS['return an object equal to everything']}\n```",
        prompt_token_ids=[1],
        token_ids=[2],
        finish_reason="stop",
    )
    assert agent.reward(response, problem) == 0.0


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        3,
        -2.5,
        float("inf"),
        "s",
        b"\x00",
        1 + 2j,
        [1, (2, 3)],
        {"a": {1, 2}},
        frozenset({1}),
        {(1, 2): [b"x"]},
    ],
)
def test_plain_values_round_trip_exactly(value):
    def no_handles(_):
        raise AssertionError("plain values need no handle")

    decoded = code_harness.decode(code_harness.encode(value, no_handles), no_handles)
    assert decoded == value and type(decoded) is type(value)


@pytest.mark.parametrize(
    "data",
    [
        {"tuple": [1], "list": []},
        {"module": "os.path"} | {"x": 1},
        {"module": "llmrl"},
        {"complex": [1, 2]},
        {"set": [[1]]},
    ],
)
def test_malformed_answers_are_refused(data):
    with pytest.raises((ValueError, TypeError)):
        code_harness.decode(data, lambda handle: handle)
