"""A batch that failed in inference, or could not reach its environment server, is refused: not banked, not
trained on, and the run stops in one line."""

import time

import pytest
import torch

from llmrl import cli
from llmrl.agents import WeightedMultiTask, placeholder_rollout
from llmrl.errors import EnvironmentUnavailableError
from llmrl.inference import Health
from llmrl.inference.interface import InferenceUnavailableError
from llmrl.rollouts import RolloutBank, RolloutPipeline, inference_failure, unreachable_environment
from llmrl.trainer.weight_sync import PolicyWeights, WeightSync
from llmrl.types import GenerationArgs, RolloutGroup, TokenRollout
from tests.unit.scripted_inference import EchoAgent, ScriptedInference, answer_of


def rollout(reward=1.0):
    return TokenRollout(
        trajectory=[[1], [2]], generation_mask=[[False], [True]], reward=reward, env_id="e", problem_id="p"
    )


def group(ok, failed, reason="inference: ConnectError: refused"):
    rollouts = [rollout() for _ in range(ok)] + [placeholder_rollout("e", "p", reason) for _ in range(failed)]
    return RolloutGroup(group_id="g", rollouts=rollouts)


def test_by_default_a_whole_group_failed_in_inference_refuses_the_batch():
    assert inference_failure([group(4, 0), group(2, 2)], None) is None
    assert inference_failure([group(4, 0), group(0, 4)], None) == (
        "4 of 8 rollouts failed in inference (inference: ConnectError: refused)"
    )
    assert inference_failure([group(0, 4, reason="reward: ValueError: bad")], None) is None  # not inference


def test_a_configured_fraction_bounds_the_failed_rollouts():
    assert inference_failure([group(3, 1), group(3, 1)], 0.25) is None
    assert inference_failure([group(2, 2), group(3, 1)], 0.25) is not None
    assert (
        inference_failure([group(4, 0), group(0, 4)], 0.5) is None
    )  # a whole group, but within the fraction


UNREACHABLE = (
    "unreachable: openenv server http://h:8000 unreachable since 2026-11-25 14:02:11: ConnectionRefusedError"
)


def test_rollouts_that_could_not_reach_their_environment_server_are_counted_apart_from_inference():
    assert unreachable_environment(3, [group(4, 0), group(2, 2, UNREACHABLE)], None) is None
    assert unreachable_environment(3, [group(4, 0), group(0, 4)], None) is None  # inference: not theirs
    assert unreachable_environment(3, [group(4, 0), group(0, 4, UNREACHABLE)], None) == (
        "e: openenv server http://h:8000 unreachable since 2026-11-25 14:02:11: ConnectionRefusedError "
        "(batch of step 3: 4 of 8 rollouts could not reach it); nothing from it was trained on or kept; "
        "rerun the same command to resume"
    )
    assert unreachable_environment(3, [group(3, 1, UNREACHABLE), group(3, 1, UNREACHABLE)], 0.25) is None
    assert unreachable_environment(3, [group(2, 2, UNREACHABLE), group(3, 1, UNREACHABLE)], 0.25) is not None
    # Half of the batch failed in inference, half could not reach its environment: each within 0.5.
    assert inference_failure([group(2, 2), group(2, 2, UNREACHABLE)], 0.5) is None
    assert unreachable_environment(3, [group(2, 2), group(2, 2, UNREACHABLE)], 0.5) is None


def test_an_environment_that_failed_one_episode_is_not_an_unreachable_server():
    environment_error = "environment: openenv server http://h:8000: RuntimeError: Server error: boom"
    assert unreachable_environment(3, [group(0, 4, environment_error)], None) is None


class FailingServer(ScriptedInference):
    """Scripted inference that, once `down` is set, fails like an unreachable OpenAI-compatible server."""

    base_url = "http://10.1.2.3:8000/v1"

    def __init__(self):
        super().__init__(lambda prompt, index: answer_of(prompt))
        self.down = False
        self.lost_at = None

    async def agenerate(self, request):
        if self.down:
            self.lost_at = self.lost_at or time.time()
            raise ConnectionRefusedError("connection refused")
        return await super().agenerate(request)

    def health(self):
        return Health(servers=(self.base_url,), unreachable_since=self.lost_at)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_refused_batch_is_not_banked_and_later_batches_are_not_drawn(tmp_path, lag):
    server = FailingServer()
    agents = WeightedMultiTask([EchoAgent(env_id="echo", seed=0, eval_size=4)], [1.0])
    bank = RolloutBank(tmp_path)
    pipeline = RolloutPipeline(
        agents,
        server,
        num_groups=2,
        group_size=2,
        generation_args=lambda step: GenerationArgs(),
        lag=lag,
        last_step=5,
        bank=bank,
    )
    try:
        pipeline.start(0)
        assert len(pipeline.get(1)) == 2
        pipeline.wait_ahead()
        server.down = True  # the batch drawn next (2 without a lag, 3 with one) fails
        pipeline.submit_ahead(1)
        with pytest.raises(InferenceUnavailableError) as refused:
            pipeline.wait_ahead() if lag else pipeline.get(2)
        message = str(refused.value)
        assert message.startswith(f"inference server at {server.base_url} unreachable since ")
        assert "4 of 4 rollouts failed in inference" in message and message.endswith(
            "rerun the same command to resume"
        )
        requests = len(server.requests)
        with pytest.raises(InferenceUnavailableError):
            pipeline._draw(3)
        assert len(server.requests) == requests  # nothing more was asked of the dead server
        assert [b.step for b in bank.read()] == (
            [1] if lag == 0 else [1, 2]
        )  # with a lag, 2 was drawn before
    finally:
        pipeline.close()


def test_a_weight_sync_to_an_unreachable_server_stops_the_run_in_one_line():
    class DeadSync:
        base_url = "http://10.1.2.3:8000/v1"
        lost_at = 1_700_000_000.0

        def weight_transport(self, kind):
            return self

        def send(self, payload, version, reset=False):
            raise RuntimeError("weight sync failed: ConnectError")

        def health(self):
            return Health(servers=(self.base_url,), unreachable_since=self.lost_at)

    inference = DeadSync()
    sync = WeightSync(PolicyWeights(torch.nn.Linear(2, 2), tied_names=()), inference)
    with pytest.raises(
        InferenceUnavailableError, match=r"unreachable since .* \(weight sync of step 4: RuntimeError"
    ):
        sync.sync(4)
    inference.lost_at = None  # a server that answered: its error is not ours to rephrase
    with pytest.raises(RuntimeError, match="^weight sync failed"):
        sync.sync(4)


@pytest.mark.parametrize(
    "error",
    [
        InferenceUnavailableError("inference server at http://h/v1 unreachable since 12:00; rerun"),
        EnvironmentUnavailableError("sums: openenv server http://h:8000 unreachable since 12:00; rerun"),
    ],
)
def test_llmrl_train_prints_the_stop_line_and_exits_75(monkeypatch, capsys, error):
    class StoppingTrainer:
        resumed, is_main, step = False, True, 0

        def __init__(self, config, resume=False):
            pass

        def run(self):
            raise error

    monkeypatch.setattr("llmrl.trainer.Trainer", StoppingTrainer)
    assert cli.main(["train", "--set", "training.steps=1"]) == cli.EXIT_TRY_AGAIN == 75
    assert capsys.readouterr().err == f"llmrl train: stopped: {error}\n"


def test_any_command_that_finds_an_environment_server_down_exits_75_in_one_line(monkeypatch, capsys):
    def evaluate(args):
        raise EnvironmentUnavailableError("sums: openenv server http://h:8000 unreachable since 12:00")

    monkeypatch.setattr("llmrl.cli.cmd_eval", evaluate)
    assert cli.main(["eval"]) == cli.EXIT_TRY_AGAIN
    assert capsys.readouterr().err == (
        "llmrl eval: stopped: sums: openenv server http://h:8000 unreachable since 12:00\n"
    )
