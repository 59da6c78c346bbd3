"""Partial rollouts: batches of the groups that complete first, none lost or trained twice, across an
interruption too, and the staleness bound."""

from __future__ import annotations

import threading
import time

import pytest

from llmrl.agents import WeightedMultiTask
from llmrl.config import ConfigError, load_config
from llmrl.inference.interface import InferenceUnavailableError
from llmrl.rollouts import PartialRolloutPipeline, RolloutBank
from llmrl.types import GenerationArgs
from tests.unit.scripted_inference import EchoAgent, ScriptedInference, answer_of

GROUPS = 4


def slow_every(nth: int, seconds: float):
    """A delay for the problems whose number is a multiple of `nth`."""
    return lambda prompt: seconds if int(answer_of(prompt)[1:]) % nth == 0 else 0.0


class Admitting(ScriptedInference):
    """Stamps responses with the version their request was admitted under, as the engines do."""

    async def agenerate(self, request):
        version = self.policy_version
        responses = await super().agenerate(request)
        return [r.model_copy(update={"policy_version": version}) for r in responses]


def agents() -> WeightedMultiTask:
    return WeightedMultiTask([EchoAgent(env_id="echo", seed=0, eval_size=4, num_problems=60)], [1.0])


def pipeline(tmp_path, inference, team, *, steps, max_staleness=None) -> PartialRolloutPipeline:
    return PartialRolloutPipeline(
        team,
        inference,
        num_groups=GROUPS,
        group_size=2,
        generation_args=lambda index: GenerationArgs(seed=index),
        lag=1,
        last_step=steps,
        bank=RolloutBank(tmp_path),
        max_staleness=max_staleness,
    )


def train(pipe, inference, first: int, last: int) -> dict[int, list[str]]:
    """Take the batches of steps first..last as the trainer does; the group ids of each."""
    batches = {}
    for step in range(first, last + 1):
        batches[step] = [g.group_id for g in pipe.get(step)]
        inference.policy_version = step  # the step's weights now serve
        pipe.submit_ahead(step)
    return batches


def index(group_id: str) -> int:
    return int(group_id.rsplit("/", 1)[1])


def test_a_slow_group_is_trained_in_a_later_batch_and_none_is_lost_or_trained_twice(tmp_path):
    inference = ScriptedInference(lambda prompt, i: answer_of(prompt), delay_s=slow_every(4, 0.3))
    pipe = pipeline(tmp_path, inference, agents(), steps=6)
    try:
        pipe.start(0)
        batches = train(pipe, inference, 1, 6)
    finally:
        pipe.close()
    trained = [g for ids in batches.values() for g in ids]
    assert len(trained) == len(set(trained)) == 6 * GROUPS
    assert all(len(ids) == GROUPS for ids in batches.values())
    # Overtaken: some group is trained in a batch after one with a later index.
    order = [index(g) for g in trained]
    assert order != sorted(order)
    recorded = RolloutBank(tmp_path).read_partial().batches
    assert {step: [f"echo/{k}" for k in ks] for step, ks in recorded.items()} == batches


@pytest.mark.parametrize("checkpointed", [1, 2])
def test_an_interruption_replays_recorded_batches_and_regenerates_what_was_running(tmp_path, checkpointed):
    # The groups launched once step 1's weights serve outlast the first run, whatever the machine's
    # load: the crash comes once one of them is generating, and cancels them. The first batches are fast.
    slow_started = threading.Event()

    def delay(prompt: str) -> float:
        if not first.policy_version:
            return 0.0
        slow_started.set()
        return 60.0

    first = ScriptedInference(lambda prompt, i: answer_of(prompt), delay_s=delay)
    first_team = agents()
    pipe = pipeline(tmp_path, first, first_team, steps=6)
    pipe.start(0)
    before = train(pipe, first, 1, 2)
    assert slow_started.wait(30)
    checkpoint_state = pipe.agent_state(checkpointed)
    if checkpointed == 1:
        RolloutBank(tmp_path).compact(1)  # step 2 trained but not saved
    # else: the checkpoint of step 2 was saved, and the run killed before it compacted the bank
    pipe.close()  # the crash: what was running is gone

    second_team = agents()
    second_team.load_state_dict(checkpoint_state)
    inference = ScriptedInference(
        lambda prompt, i: answer_of(prompt), delay_s=slow_every(3, 0.5), policy_version=checkpointed
    )
    resumed = pipeline(tmp_path, inference, second_team, steps=6)
    try:
        assert resumed.start(checkpointed) == 2 - checkpointed  # step 2's batch again, as it was
        after = train(resumed, inference, checkpointed + 1, 6)
        regenerated = resumed.pop_metrics().get("rollout/regenerated_after_interruption", 0.0)
    finally:
        resumed.close()
    assert after.get(2, before[2]) == before[2]
    assert regenerated > 0  # the slow groups running at the crash
    trained = before[1] + [g for step in range(2, 7) for g in after.get(step, before.get(step, []))]
    # Every problem drawn once, none skipped: the regenerated groups drew the problems they had.
    assert sorted(trained, key=index) == [f"echo/{k}" for k in range(6 * GROUPS)]


def test_groups_older_than_max_staleness_are_generated_again_for_the_same_problems(tmp_path):
    inference = Admitting(lambda prompt, i: answer_of(prompt), delay_s=slow_every(5, 0.4))
    pipe = pipeline(tmp_path, inference, agents(), steps=8, max_staleness=1)
    batches: dict[int, list] = {}
    regenerated = 0.0
    try:
        pipe.start(0)
        for step in range(1, 9):
            batches[step] = pipe.get(step)
            regenerated += pipe.pop_metrics()["rollout/stale_regenerated"]
            inference.policy_version = step
            pipe.submit_ahead(step)
            time.sleep(0.05)  # a step's training
    finally:
        pipe.close()
    assert regenerated > 0
    assert all(step - 1 - g.rollouts[0].policy_version <= 1 for step, gs in batches.items() for g in gs)
    # None skipped, none twice: the stale groups were trained later, for the problems they had drawn.
    trained = sorted((g.group_id for gs in batches.values() for g in gs), key=index)
    assert trained == [f"echo/{k}" for k in range(8 * GROUPS)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["training.partial_rollouts=true"], "needs training.generation_lag >= 1"),
        (["training.max_staleness=2"], "only partial rollouts carry groups over"),
        (
            ["training.partial_rollouts=true", "training.generation_lag=2", "training.max_staleness=1"],
            "below training.generation_lag",
        ),
        (
            [
                "training.partial_rollouts=true",
                "training.generation_lag=1",
                "algorithm.dynamic_sampling=true",
            ],
            "not with training.partial_rollouts",
        ),
    ],
)
def test_partial_rollouts_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        load_config(None, overrides)


def test_a_batch_failed_in_inference_stops_the_run_and_is_not_kept(tmp_path):
    def refused(prompt, index):
        raise ConnectionRefusedError("connection refused")

    inference = ScriptedInference(refused)
    pipe = pipeline(tmp_path, inference, agents(), steps=3)
    try:
        pipe.start(0)
        with pytest.raises(InferenceUnavailableError, match="rollouts failed in inference"):
            pipe.get(1)
        with pytest.raises(InferenceUnavailableError):
            pipe.wait_ahead()
    finally:
        pipe.close()
    records = RolloutBank(tmp_path).read_partial()  # the refused groups are to be generated again
    assert records.batches == {} and len(records.pending) == 2 * GROUPS
    assert len(records.groups) <= GROUPS
