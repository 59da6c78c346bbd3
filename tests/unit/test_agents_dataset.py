"""DatasetAgent: local file formats, column mapping, prompt templates, clear errors, exact-match reward."""

import asyncio
import json

import pytest
from scripted_inference import ScriptedInference

from llmrl.agents.dataset import DatasetAgent
from llmrl.rewards.answers import after_hashes, extract_answer, last_boxed, last_tagged, normalize_answer
from llmrl.types import ChatMessage, InferenceResponse

ROWS = [{"q": f"What is {i} + {i}?", "a": str(2 * i), "topic": "sums", "uid": f"s{i}"} for i in range(12)]


def write_rows(tmp_path, suffix, rows=ROWS):
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import pandas

        frame = pandas.DataFrame(rows)
        frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_parquet(path)
    return str(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_local_formats_load_with_a_column_mapping(tmp_path, suffix):
    agent = DatasetAgent(
        data_files=write_rows(tmp_path, suffix),
        prompt_column="q",
        answer_column="a",
        id_column="uid",
        prompt_template="[{topic}] {prompt}",
        chat=False,
        eval_size=2,
    )
    problems = {p.id: p for p in agent.train_problems + agent.eval_problems}
    assert len(problems) == 12
    assert problems["s3"].prompt == "[sums] What is 3 + 3?"
    assert str(problems["s3"].answer) == "6"


def test_chat_prompts_with_a_system_message(tmp_path):
    agent = DatasetAgent(
        data_files=write_rows(tmp_path, ".jsonl"),
        prompt_column="q",
        answer_column="a",
        system_prompt="Be brief.",
    )
    eval_agent = DatasetAgent(
        data_files=write_rows(tmp_path, ".jsonl"),
        eval_data_files=write_rows(tmp_path, ".json", ROWS[:3]),
        prompt_column="q",
        answer_column="a",
    )
    problem = agent.prompts()[0]
    assert problem.prompt == [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="What is 0 + 0?"),
    ]
    assert problem.id == "train-0"
    assert len(eval_agent.train_problems) == 12 and [p.id for p in eval_agent.eval_problems] == [
        "eval-0",
        "eval-1",
        "eval-2",
    ]


def test_a_missing_column_lists_the_columns_the_data_has(tmp_path):
    path = write_rows(tmp_path, ".jsonl")
    with pytest.raises(ValueError) as info:
        DatasetAgent(data_files=path, prompt_column="question", answer_column="a")
    assert (
        str(info.value)
        == f"{path}: prompt_column='question': not a column; the data's columns are ['q', 'a', 'topic', 'uid']"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"prompt_template": "{prompt} ({level})"},
            r"prompt_template '\{prompt\} \(\{level\}\)' cannot be filled .*'level'",
        ),
        ({"data_files": "nope.jsonl"}, "data_files: no such file: nope.jsonl"),
        ({"data_files": None}, "exactly one of path"),
        ({"eval_split": "test"}, "eval_split needs path"),
    ],
)
def test_configuration_errors_name_the_argument(tmp_path, kwargs, message):
    args = {
        "data_files": write_rows(tmp_path, ".jsonl"),
        "prompt_column": "q",
        "answer_column": "a",
        **kwargs,
    }
    with pytest.raises(ValueError, match=message):
        DatasetAgent(**args)


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("hello")
    with pytest.raises(ValueError, match=r"data_files must all have one of the extensions .*\['\.txt'\]"):
        DatasetAgent(data_files=str(path))


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("The answer is \\boxed{6}.", 1.0),
        ("<answer> 6 </answer>", 1.0),
        ("3 + 3 = 6\n#### 6", 1.0),
        ("6", 1.0),
        ("6.0", 1.0),
        ("\\boxed{7}", 0.0),
        ("<answer>6</answer> then \\boxed{5}", 0.0),  # the boxed answer wins
        ("I think it's 6", 0.0),
    ],
)
def test_exact_match_reward_on_the_marked_answer(tmp_path, completion, reward):
    agent = DatasetAgent(data_files=write_rows(tmp_path, ".jsonl"), prompt_column="q", answer_column="a")
    problem = agent.prompts()[3]
    response = InferenceResponse(text=completion, prompt_token_ids=[1], token_ids=[2], finish_reason="stop")
    assert agent.reward(response, problem) == reward


def test_rollouts_from_a_dataset(tmp_path):
    agent = DatasetAgent(
        data_files=write_rows(tmp_path, ".jsonl"),
        prompt_column="q",
        answer_column="a",
        chat=False,
        eval_size=2,
    )

    def reply(prompt, i):
        number = int(prompt.split()[2])
        return f"\\boxed{{{2 * number}}}"

    groups = asyncio.run(agent.group_rollouts(ScriptedInference(reply), 3, 2))
    assert all(r.reward == 1.0 for g in groups for r in g.rollouts)


def test_answer_extractors():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == ("\\frac{1}{2}", 33)
    assert last_boxed("\\boxed{unclosed") is None
    assert last_tagged("<answer>1</answer><answer>\n2 \n</answer>") == ("2", 39)
    assert after_hashes("work\n#### 1,234\n") == ("1,234", 15)
    assert after_hashes("#### ") is None
    assert extract_answer("no answer here") is None


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("1,000", "1000", True),
        ("  Paris. ", "paris", True),
        ("2.50", "2.5", True),
        ("$5", "5", True),
        ("1", "2", False),
    ],
)
def test_normalize_answer(a, b, same):
    assert (normalize_answer(a) == normalize_answer(b)) == same
