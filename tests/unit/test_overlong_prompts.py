"""Prompts that cannot fit the model's context: found when the data loads (skipped with one line, or
refused), and a request refused at run time for its data drops its problem, never stops the run."""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging

import pytest
from scripted_inference import EchoAgent, ScriptedInference

from llmrl.agents import PromptRoom, placeholder_rollout
from llmrl.agents.base import failed_for_data, failed_in_inference
from llmrl.agents.dataset import DatasetAgent
from llmrl.errors import UserError
from llmrl.inference.engine import LocalEngine
from llmrl.inference.interface import RequestRejected
from llmrl.inference.prompts import overlong_prompts, request_prompt_ids
from llmrl.rollouts.checks import BatchChecks
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest, RolloutGroup


def token_counts(tokenizer, prompts, args):
    return [
        len(request_prompt_ids(tokenizer, InferenceRequest(prompt=p, generation_args=args))) for p in prompts
    ]


@pytest.mark.parametrize("chat", [False, True])
def test_overlong_prompts_are_those_a_request_would_count_over_the_limit(tiny_model, chat):
    _, tokenizer = tiny_model
    texts = [" ".join(str(i * j) for j in range(i)) for i in range(0, 60, 3)]
    prompts = [[ChatMessage(role="user", content=t)] for t in texts] if chat else [t or "x" for t in texts]
    args = GenerationArgs()
    counts = token_counts(tokenizer, prompts, args)
    for limit in (1, 20, sorted(counts)[len(counts) // 2], max(counts)):
        expected = {i: n for i, n in enumerate(counts) if n > limit}
        assert overlong_prompts(tokenizer, prompts, args, limit) == expected


def rows_file(tmp_path, long_rows: dict[int, int], rows: int = 12):
    """A jsonl of `rows` short sums, where row i of `long_rows` repeats its question `long_rows[i]` times."""
    path = tmp_path / "sums.jsonl"
    lines = []
    for i in range(rows):
        question = f"What is {i} + {i}?"
        lines.append(json.dumps({"q": " ".join([question] * long_rows.get(i, 1)), "a": str(2 * i)}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def room(tokenizer, context=256, refuse=False) -> PromptRoom:
    return PromptRoom(context=context, overlong=functools.partial(overlong_prompts, tokenizer), refuse=refuse)


def dataset_agent(path, **kwargs) -> DatasetAgent:
    return DatasetAgent(data_files=path, prompt_column="q", answer_column="a", chat=False, **kwargs)


def test_a_prompt_that_leaves_no_room_for_max_tokens_is_skipped_with_one_line(tiny_model, tmp_path, caplog):
    _, tokenizer = tiny_model
    path = rows_file(tmp_path, {3: 40, 7: 2})
    agent = dataset_agent(path, eval_size=0, generation_args={"max_tokens": 64})
    with caplog.at_level(logging.WARNING):
        agent.drop_overlong_prompts(room(tokenizer), GenerationArgs(max_tokens=16))
    assert [p.id for p in agent.train_problems] == [f"train-{i}" for i in range(12) if i != 3]
    (line,) = [r.getMessage() for r in caplog.records]
    # The agent's own max_tokens counts, over the run's; the line names the row and its file.
    assert "1 of 12 training and 0 of 0 evaluation problems" in line
    assert "192 tokens that the model's context of 256 leaves beside max_tokens=64" in line
    assert f"problem train-3 ({path}, row 3 counting from 0)" in line
    assert "training.overlong_prompts: skip" in line


def test_held_out_problems_stay_held_out_whatever_is_skipped(tiny_model, tmp_path):
    _, tokenizer = tiny_model
    path = rows_file(tmp_path, {i: 40 for i in range(0, 12, 2)})
    before = dataset_agent(path, eval_size=4)
    held_out = {p.id for p in before.eval_problems}
    agent = dataset_agent(path, eval_size=4)
    agent.drop_overlong_prompts(room(tokenizer), GenerationArgs(max_tokens=16))
    kept = {p.id for p in agent.eval_problems}
    assert kept == {i for i in held_out if int(i.split("-")[1]) % 2}
    assert not kept & {p.id for p in agent.train_problems}


def test_refuse_names_the_problems_and_the_setting(tiny_model, tmp_path):
    _, tokenizer = tiny_model
    agent = dataset_agent(rows_file(tmp_path, {5: 40}), eval_size=0)
    with pytest.raises(UserError, match=r"problem train-5 .* set training.overlong_prompts: skip"):
        agent.drop_overlong_prompts(room(tokenizer, refuse=True), GenerationArgs(max_tokens=16))


def test_no_room_at_all_or_no_problem_left_is_an_error(tiny_model, tmp_path):
    _, tokenizer = tiny_model
    agent = dataset_agent(rows_file(tmp_path, {}), eval_size=0)
    with pytest.raises(UserError, match="max_tokens=256 completion tokens leave no room for a prompt"):
        agent.drop_overlong_prompts(room(tokenizer), GenerationArgs(max_tokens=256))
    agent = dataset_agent(rows_file(tmp_path, {i: 40 for i in range(12)}), eval_size=0)
    with pytest.raises(UserError, match="no training problem is left"):
        agent.drop_overlong_prompts(room(tokenizer), GenerationArgs(max_tokens=16))


def test_a_request_refused_for_its_data_drops_that_problem_only():
    def reply(prompt, index):
        if "say a3" in prompt:
            raise RequestRejected("prompt: 2117 tokens leave no room for a completion")
        return "a" + prompt.rsplit("say a", 1)[1]

    agent = EchoAgent(num_problems=6, eval_size=0, env_id="echo")
    groups = asyncio.run(agent.group_rollouts(ScriptedInference(reply), 6, 2))
    failed = [g for g in groups if not any(r.is_valid for r in g.rollouts)]
    assert len(failed) == 1 and all(
        failed_for_data(r) and not failed_in_inference(r) for r in failed[0].rollouts
    )
    assert failed[0].rollouts[0].failure_reason == (
        "data: problem p3: prompt: 2117 tokens leave no room for a completion"
    )
    assert agent.pop_metrics()["failures/data"] == 1
    checks = BatchChecks(ScriptedInference("x"), None, 0.5)
    assert checks.refusal(1, groups, 0.0) is None  # trained on without that problem


def test_a_batch_whose_every_request_was_refused_for_its_data_stops_with_a_user_error():
    reason = "data: problem p0: prompt: 2117 tokens leave no room for a completion"
    groups = [RolloutGroup(group_id="g", rollouts=[placeholder_rollout("echo", "p0", reason)] * 2)]
    refusal = BatchChecks(ScriptedInference("x"), None, 0.5).refusal(4, groups, 0.0)
    assert isinstance(refusal, UserError)
    assert str(refusal) == (
        f"every one of the 2 rollouts of step 4 was refused by the inference for its data, so nothing is "
        f"left to train on; most often, 2 times: {reason}"
    )


def test_the_embedded_engine_rejects_a_prompt_that_fills_its_context(tiny_model):
    model, tokenizer = tiny_model
    engine = LocalEngine(copy.deepcopy(model), tokenizer)
    try:
        with pytest.raises(RequestRejected, match="leave no room for a completion"):
            engine.generate(InferenceRequest(prompt="1 + 1 = " * 2000))
    finally:
        engine.close()
