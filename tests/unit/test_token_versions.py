"""A weight version on every sampled token: responses, trajectories, rollouts, staleness metrics, and the
`inference.weight_update` setting."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from llmrl.agents.trajectory import Trajectory
from llmrl.config import InferenceConfig, load_config
from llmrl.inference.vllm.compatibility import vllm_pause_mode
from llmrl.rollouts import staleness_metrics
from llmrl.telemetry import RolloutLog, read_jsonl
from llmrl.types import GenerationArgs, InferenceResponse, RolloutGroup, TokenRollout


def completion(tokens: list[int], version: int, changes=()) -> InferenceResponse:
    return InferenceResponse(
        text="x",
        prompt_token_ids=[1],
        token_ids=tokens,
        logprobs=[-0.5] * len(tokens),
        finish_reason="stop",
        policy_version=version,
        version_changes=list(changes),
    )


def test_a_response_spanning_updates_expands_to_one_version_per_token():
    response = completion([10, 11, 12, 13, 14], 3, [(2, 4), (4, 6)])
    assert response.token_versions() == [3, 3, 4, 4, 6]
    assert completion([10, 11], 3).token_versions() == [3, 3]
    again = InferenceResponse.model_validate_json(response.model_dump_json())
    assert again.version_changes == [(2, 4), (4, 6)]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ([(0, 4)], "token index 0 must be above 0"),  # the first token is policy_version's
        ([(5, 4)], "below the 5 tokens"),
        ([(2, 4), (2, 5)], "token index 2 must be above 2"),
        ([(2, 3)], "version 3 at token 2 must be newer than 3"),
        ([(2, 5), (3, 4)], "version 4 at token 3 must be newer than 5"),
    ],
)
def test_version_changes_out_of_order_are_refused(changes, message):
    with pytest.raises(ValidationError, match=message):
        completion([10, 11, 12, 13, 14], 3, changes)


def test_a_trajectory_records_where_each_turn_and_update_changed_the_version():
    trajectory = Trajectory(GenerationArgs())
    trajectory.add_context([1, 2, 3], "prompt")
    trajectory.add_completion(completion([10, 11, 12], 2, [(1, 3)]))  # an update within the turn
    trajectory.add_context([4], " user")
    trajectory.add_completion(completion([13, 14], 3))  # same version as the turn before ended on
    trajectory.add_context([5], " user")
    trajectory.add_completion(completion([15], 5))  # admitted after two more updates
    rollout = trajectory.rollout("env", "p", 1.0)
    assert rollout.policy_version == 2 and rollout.newest_version == 5
    assert rollout.version_changes == [(4, 3), (10, 5)]
    sampled = [v for v, m in zip(rollout.token_versions, rollout.mask, strict=True) if m]
    assert sampled == [2, 3, 3, 3, 3, 5]


def test_a_trajectory_refuses_a_version_going_back():
    trajectory = Trajectory(GenerationArgs())
    trajectory.add_context([1], "prompt")
    trajectory.add_completion(completion([10], 4))
    trajectory.add_context([2], " user")
    with pytest.raises(ValueError, match="weight version 3 after version 4"):
        trajectory.add_completion(completion([11], 3))


def rollout(version: int, changes=(), generated: int = 4, status="ok") -> TokenRollout:
    return TokenRollout(
        env_id="env",
        problem_id="p",
        status=status,
        trajectory=[[1, 2], list(range(generated))],
        generation_mask=[[False, False], [True] * generated],
        policy_version=version,
        version_changes=list(changes),
    )


def test_staleness_is_counted_per_sampled_token():
    groups = [
        RolloutGroup(group_id="a", rollouts=[rollout(3, [(4, 4)]), rollout(4)]),  # 2 tokens of v3, 6 of v4
        RolloutGroup(group_id="b", rollouts=[rollout(2, status="failed")]),  # not trained: not counted
    ]
    metrics = staleness_metrics(groups, trained_version=4)
    assert metrics == {
        "rollout/staleness_mean": 2 / 8,
        "rollout/staleness_max": 1.0,
        "rollout/token_age/0": 6 / 8,
        "rollout/token_age/1": 2 / 8,
    }
    extra = rollout(2).model_copy(update={"extra_sequences": [rollout(4)]})  # an agent program's second call
    assert (
        staleness_metrics([RolloutGroup(group_id="c", rollouts=[extra])], 4)["rollout/staleness_mean"] == 1.0
    )


def test_rollouts_log_shows_the_oldest_and_newest_version(tmp_path):
    with RolloutLog(tmp_path / "rollouts.jsonl") as log:
        log.log(1, rollout(3, [(4, 4)]))
    (record,) = read_jsonl(tmp_path / "rollouts.jsonl")
    assert (record["policy_version"], record["newest_version"]) == (3, 4)


def test_the_former_vllm_pause_mode_loads_as_weight_update(caplog):
    with caplog.at_level(logging.WARNING):
        config = InferenceConfig.model_validate({"type": "vllm", "vllm": {"pause_mode": "abort"}})
    assert config.weight_update == "abort"
    assert "inference.vllm.pause_mode is now inference.weight_update" in caplog.text
    assert load_config(None, ["inference.weight_update=in_flight"]).inference.weight_update == "in_flight"
    with pytest.raises(ValueError, match="inference.weight_update"):
        load_config(None, ["inference.weight_update=sometimes"])


def test_vllm_runs_in_flight_as_wait_and_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        assert vllm_pause_mode(InferenceConfig(weight_update="in_flight")) == "wait"
    assert "in_flight runs as wait on vLLM" in caplog.text
    assert vllm_pause_mode(InferenceConfig(weight_update="abort")) == "abort"
