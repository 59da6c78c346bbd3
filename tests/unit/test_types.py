"""Wire types: JSON round trips, merge semantics, and errors that name the bad field."""

import pytest
from pydantic import ValidationError

from llmrl.types import (
    ChatMessage,
    EvaluationResponse,
    EvaluationResult,
    GenerationArgs,
    InferenceRequest,
    InferenceResponse,
    RolloutGroup,
    TokenRollout,
)


def _token_rollout(**overrides):
    fields = dict(
        trajectory=[[1, 2, 3], [4, 5]],
        generation_mask=[[False, False, False], [True, True]],
        logprobs=[[0.0, 0.0, 0.0], [-0.5, -1.25]],
        reward=1.0,
        env_id="arithmetic",
        problem_id="p1",
        policy_version=3,
        text=["1+2=", "3"],
    )
    fields.update(overrides)
    return TokenRollout(**fields)


EXAMPLES = [
    GenerationArgs(
        temperature=0.7, top_p=0.9, top_k=5, max_tokens=12, stop=("\n",), stop_token_ids=(2,), seed=7
    ),
    ChatMessage(role="user", content="hi"),
    InferenceRequest(prompt="What is 1+1?", n=4),
    InferenceRequest(
        prompt=[ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="2+2?")]
    ),
    InferenceResponse(
        text="4", prompt_token_ids=[1, 2], token_ids=[9, 3], logprobs=[-0.1, -0.2], finish_reason="stop"
    ),
    _token_rollout(),
    RolloutGroup(
        group_id="g0", rollouts=[_token_rollout(), _token_rollout(reward=0.0, status="placeholder")]
    ),
    EvaluationResult(
        problem_id="p", prompt="2+2?", completions=["4", "5"], rewards=[1.0, 0.0], greedy_reward=1.0
    ),
    EvaluationResponse(
        env_id="e", results=[EvaluationResult(problem_id="p", prompt="x", completions=["a"], rewards=[0.5])]
    ),
]


@pytest.mark.parametrize("obj", EXAMPLES, ids=lambda o: type(o).__name__)
def test_json_round_trip(obj):
    restored = type(obj).model_validate_json(obj.model_dump_json())
    assert restored == obj


def test_generation_args_is_immutable():
    args = GenerationArgs()
    with pytest.raises(ValidationError):
        args.temperature = 0.5


def test_merge_overlays_only_fields_set_in_other():
    base = GenerationArgs(temperature=0.7, max_tokens=64, seed=1)
    merged = base.merge(GenerationArgs(max_tokens=8))
    assert merged == GenerationArgs(temperature=0.7, max_tokens=8, seed=1)
    # an explicitly set default value still wins over the base
    assert base.merge(GenerationArgs(temperature=1.0)).temperature == 1.0
    assert base.merge({"top_k": 3}).top_k == 3
    assert base.merge(None) is base
    assert base.temperature == 0.7  # merge never mutates


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temprature": 1.0}, "temprature"),
    ],
)
def test_invalid_generation_args_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as info:
        GenerationArgs(**kwargs)
    assert [e["loc"][0] for e in info.value.errors()] == [field]


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt_is_rejected(prompt):
    with pytest.raises(ValidationError) as info:
        InferenceRequest(prompt=prompt)
    assert "prompt must" in str(info.value)


def test_empty_text_after_prompt_token_ids_asks_for_a_completion_of_the_ids():
    assert InferenceRequest(prompt="", prompt_token_ids=[5, 6]).prompt_token_ids == [5, 6]


def test_request_rejects_bad_n_and_nested_args():
    with pytest.raises(ValidationError) as info:
        InferenceRequest.model_validate({"prompt": "x", "n": 0, "generation_args": {"top_p": 2}})
    locations = {e["loc"] for e in info.value.errors()}
    assert locations == {("n",), ("generation_args", "top_p")}


def test_chat_message_role_is_checked():
    with pytest.raises(ValidationError) as info:
        ChatMessage(role="robot", content="x")
    assert info.value.errors()[0]["loc"] == ("role",)


def test_response_needs_one_logprob_per_token():
    with pytest.raises(ValidationError, match="one logprob per completion token"):
        InferenceResponse(
            text="", prompt_token_ids=[1], token_ids=[1, 2], logprobs=[0.0], finish_reason="stop"
        )
    with pytest.raises(ValidationError) as info:
        InferenceResponse(text="", prompt_token_ids=[1], token_ids=[], finish_reason="done")
    assert info.value.errors()[0]["loc"] == ("finish_reason",)


def test_token_rollout_flat_views_and_shape_checks():
    rollout = _token_rollout()
    assert rollout.tokens == [1, 2, 3, 4, 5]
    assert rollout.mask == [False, False, False, True, True]
    assert rollout.flat_logprobs == [0.0, 0.0, 0.0, -0.5, -1.25]
    assert rollout.num_generated == 2
    assert rollout.is_valid and not _token_rollout(status="failed").is_valid
    with pytest.raises(ValidationError, match="generation_mask"):
        _token_rollout(generation_mask=[[False], [True, True]])
    with pytest.raises(ValidationError, match="logprobs"):
        _token_rollout(logprobs=[[0.0, 0.0, 0.0], [-0.5]])
    with pytest.raises(ValidationError) as info:
        _token_rollout(reward=float("nan"))
    assert info.value.errors()[0]["loc"] == ("reward",)


def test_rollout_group_needs_rollouts():
    with pytest.raises(ValidationError) as info:
        RolloutGroup(group_id="g", rollouts=[])
    assert info.value.errors()[0]["loc"] == ("rollouts",)


def test_generation_args_name_the_filters_they_sample_through():
    assert GenerationArgs().filters == []
    assert GenerationArgs(temperature=0.7, top_p=1.0).filters == []
    assert GenerationArgs(top_k=5, top_p=0.9, min_p=0.1).filters == ["top_k", "top_p", "min_p"]
