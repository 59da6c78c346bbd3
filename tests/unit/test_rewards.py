"""verl-style built-in scorers and TRL-/verl-style reward functions."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest

from llmrl import registry
from llmrl.errors import UserCodeFailure
from llmrl.rewards import RewardFunction, Sample, combine, default_compute_score, normalize_dapo_answer
from llmrl.rewards.scorers import gsm8k_flexible


@pytest.mark.parametrize(
    ("data_source", "completion", "ground_truth", "score"),
    [
        ("openai/gsm8k", "16 * 15 = 240\n#### 240", "240", 1.0),
        ("openai/gsm8k", "#### 1,000", "1000", 1.0),  # equal after normalisation
        ("openai/gsm8k", "#### $12.50", "12.5", 1.0),
        ("openai/gsm8k", "#### 239", "240", 0.0),
        ("openai/gsm8k", "The answer is 240.", "240", 0.0),  # strict: no ####
        ("lighteval/MATH", "so the answer is $\\boxed{\\frac{3}{4}}$", "\\frac{3}{4}", 1.0),
        ("lighteval/MATH", "\\boxed{0.75}", "\\frac{3}{4}", 1.0),  # equal only by math-verify
        ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{x+1}", "1+x", 1.0),
        ("HuggingFaceH4/MATH-500", "\\boxed{\\frac{2}{3}}", "The ratio is \\boxed{\\dfrac{2}{3}}.", 1.0),
        ("lighteval/MATH", "\\boxed{0.7}", "\\frac{3}{4}", 0.0),
        ("lighteval/MATH", "0.75", "\\frac{3}{4}", 0.0),  # no boxed answer
        ("math_dapo", "Let me think.\nAnswer: 34", "34", 1.0),
        ("math_dapo", "answer: $34$ dollars", "34", 1.0),  # DAPO's normalisation drops $ and units
        ("math_dapo", "Answer: 1,000", "1000", 1.0),
        ("math_dapo", "Answer: 12\nWait, no.\nAnswer: \\frac{1}{2}", "\\frac12", 1.0),  # the last one counts
        ("math_dapo", "Answer: 35", "34", 0.0),
        ("math_dapo", "The answer is 34", "34", 0.0),  # no Answer: line
        ("aime2024", "Answer: 204", "204", 1.0),
        ("arithmetic", "57<|im_end|>", "57", 1.0),
        ("arithmetic", "58", "57", 0.0),
        ("gsm8k", "#### 240", "240", 1.0),
        ("math", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("countdown", "<answer>(3 + 5) * 2</answer>", {"numbers": [2, 3, 5], "target": 16}, 1.0),
    ],
)
def test_default_compute_score(data_source, completion, ground_truth, score):
    assert default_compute_score(data_source, completion, ground_truth) == score


def test_gsm8k_flexible_takes_the_last_number():
    assert gsm8k_flexible("openai/gsm8k", "5 + 7 = 12, so it costs $1,200.", "1200") == 1.0
    assert gsm8k_flexible("openai/gsm8k", "no numbers", "1") == 0.0


def test_dapo_normalisation():
    assert normalize_dapo_answer("x = \\text{5 cm}") == "5"
    assert normalize_dapo_answer("\\boxed{10^{\\circ}}") == "10"
    assert normalize_dapo_answer("\\frac12") == "\\frac{1}{2}"


def test_an_unknown_data_source_names_the_known_ones():
    with pytest.raises(
        ValueError, match=r"no built-in scorer for data_source 'my/data'; known: openai/gsm8k"
    ):
        default_compute_score("my/data", "x", "y")


def sample(completion="57", prompt="What is 20 + 37?", **columns):
    return Sample(
        prompt=prompt,
        completion=completion,
        completion_ids=[1, 2],
        ground_truth="57",
        data_source="arithmetic",
        extra_info={"index": 3},
        columns=columns,
    )


def test_trl_style_functions_get_lists_and_columns_and_combine_by_weight():
    seen = {}

    def accuracy(prompts, completions, completion_ids, solution, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, kwargs=kwargs)
        return [float(c == s) for c, s in zip(completions, solution, strict=True)]

    def no_opinion(completions, **kwargs):
        return [None]

    functions = [
        RewardFunction.from_config({"function": accuracy, "weight": 2.0}, "r[0]"),
        RewardFunction.from_config({"function": no_opinion, "weight": 5.0}, "r[1]"),
    ]
    reward = combine(functions, sample(solution="57", topic="sums"))
    assert reward.value == 2.0 and reward.components == {"accuracy": 1.0}  # None: left out
    assert seen == {
        "prompts": ["What is 20 + 37?"],
        "completions": ["57"],
        "completion_ids": [[1, 2]],
        "kwargs": {"topic": ["sums"]},
    }


def test_trl_conversational_completions_are_message_lists_and_unnamed_columns_are_not_passed():
    def first_word(completions, solution):  # no **kwargs: gets only what it names
        return [float(completions[0][0]["content"].split()[0] == solution[0])]

    function = RewardFunction.from_config({"function": first_word}, "r")
    chat = [{"role": "user", "content": "What is 20 + 37?"}]
    assert function.score([sample("57 it is", prompt=chat, solution="57", other=1)]) == [(1.0, {})]


def test_verl_style_functions_and_their_dict_results():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {
            "score": float(solution_str == ground_truth),
            "acc": True,
            "pred": solution_str,
            "index": extra_info["index"],
        }

    function = RewardFunction.from_config({"function": compute_score, "name": "exact"}, "r")
    assert function.style == "verl"
    reward = combine([function], sample())
    assert reward.value == 1.0
    assert reward.components == {"exact": 1.0, "exact/acc": 1.0, "exact/index": 3.0}  # strings are not logged


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"function": lambda x, y: 0.0}, r"cannot tell the calling convention .*\['x', 'y'\].*style: trl"),
        (
            {"function": "nowhere:accuracy"},
            r"r\.function: 'nowhere:accuracy': module 'nowhere' is not a plug-in",
        ),
        (
            {"function": "accuracy_reward"},
            r"r\.function: 'accuracy_reward' is not a built-in reward function",
        ),
        ({"function": "math_dapo", "weight": "high"}, r"r\.weight: expected a finite number"),
        ({"function": "math_dapo", "style": "openrlhf"}, r"r\.style: expected one of \['trl', 'verl'\]"),
        ({"function": "math_dapo", "name": "mean"}, r"r\.name: 'mean' is taken"),
        ({"function": "math_dapo", "wieght": 1}, r"r: unknown keys \['wieght'\]"),
        ({"weight": 1}, r"r\.function: required"),
    ],
)
def test_bad_entries_are_errors_that_name_the_entry(entry, message):
    with pytest.raises(ValueError, match=message):
        RewardFunction.from_config(entry, "r")


def test_bad_return_values_raise():
    def scored(function):
        return combine([RewardFunction.from_config(function, "r")], sample())

    with pytest.raises(UserCodeFailure, match=r"one value per completion \(1\)"):
        scored(lambda completions, **kw: 1.0)
    with pytest.raises(UserCodeFailure, match="expected a finite number"):
        scored(lambda completions, **kw: ["high"])
    with pytest.raises(UserCodeFailure, match="without 'score'"):
        scored(lambda solution_str, **kw: {"acc": 1})
    with pytest.raises(UserCodeFailure, match="returned nan; expected a finite number"):  # None: not scored
        scored(lambda completions, **kw: [math.nan])


def test_plugin_functions_resolve_only_from_plugin_modules(tmp_path, monkeypatch):
    (tmp_path / "my_scores.py").write_text(
        textwrap.dedent("""
        def brevity(completions, **kwargs):
            return [1.0 / len(c) for c in completions]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_plugin_modules", set())
    with pytest.raises(ValueError, match="not a plug-in of this config"):
        RewardFunction.from_config({"function": "my_scores:brevity"}, "r")
    registry.import_plugins(["my_scores"])
    assert (
        combine([RewardFunction.from_config({"function": "my_scores:brevity"}, "r")], sample("ab")).value
        == 0.5
    )
    with pytest.raises(ValueError, match="has no function 'missing'"):
        RewardFunction.from_config({"function": "my_scores:missing"}, "r")
    monkeypatch.delitem(sys.modules, "my_scores")


def test_plugins_may_be_python_files(tmp_path, monkeypatch):
    path = tmp_path / "file_scores.py"
    path.write_text("def constant(completions, **kwargs):\n    return [0.25]\n")
    monkeypatch.setattr(registry, "_plugin_modules", set())
    registry.import_plugins([str(path)])
    assert (
        combine([RewardFunction.from_config({"function": "file_scores:constant"}, "r")], sample()).value
        == 0.25
    )
    monkeypatch.delitem(sys.modules, "file_scores")
    with pytest.raises(registry.RegistryError, match="no such file"):
        registry.import_plugins([str(tmp_path / "absent.py")])


def test_builtin_scorers_need_no_plugin():
    function = RewardFunction.from_config({"function": "default_compute_score"}, "r")
    assert function.style == "verl" and function.batch == "completion"
    assert function.score([sample()]) == [(1.0, {})]
