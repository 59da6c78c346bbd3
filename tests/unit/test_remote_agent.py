"""RemoteAgent against an in-process environment server (httpx.ASGITransport) and against failing
transports."""

import asyncio
import time

import httpx
import pytest
from env_server_helpers import (
    ENVIRONMENTS,
    SERVER_URL,
    RecordingFactory,
    ScriptedEndpoint,
    make_app,
    make_config,
    transport,
)
from scripted_inference import EchoAgent, ScriptedInference, answer_of

from llmrl.agents import PassAtKAgent, WeightedMultiTask, build_agents, evaluation_metrics
from llmrl.agents.base import failed_unreachable
from llmrl.agents.remote import RemoteAgent, RemoteError, RemoteUnavailableError
from llmrl.config import EnvironmentConfig
from llmrl.envs.arithmetic import ArithmeticAgent
from llmrl.types import GenerationArgs

ARGS = GenerationArgs(max_tokens=8, seed=11)


def run(coroutine):
    return asyncio.run(coroutine)


def remote(app, remote_env_id="add2", **kwargs):
    return RemoteAgent(SERVER_URL, remote_env_id=remote_env_id, transport=transport(app), **kwargs)


def failing_transport(answer):
    """A transport whose every request ends with `answer(request)` (a response, or an exception raised)."""
    attempts = []

    def handler(request):
        attempts.append(request)
        return answer(request)

    return httpx.MockTransport(handler), attempts


def test_rollouts_and_evaluation_equal_the_local_agents_with_the_same_seed():
    server_inference = ScriptedEndpoint()
    app = make_app(make_config(seed=5), RecordingFactory(server_inference))
    agent = remote(app)
    local = ArithmeticAgent(digits=2, eval_size=6, seed=5, env_id="add2")
    local_inference = ScriptedEndpoint()

    remote_groups = run(agent.group_rollouts(ScriptedEndpoint(), 3, 2, ARGS))
    local_groups = run(local.group_rollouts(local_inference, 3, 2, ARGS))
    assert [g.model_dump() for g in remote_groups] == [g.model_dump() for g in local_groups]
    assert server_inference.requests == local_inference.requests  # same prompts, same derived seeds

    remote_eval = run(agent.evaluate(ScriptedEndpoint(), 4, samples_per_prompt=2, greedy=True))
    local_eval = run(local.evaluate(ScriptedEndpoint(), 4, samples_per_prompt=2, greedy=True))
    assert remote_eval.results == local_eval.results and remote_eval.env_id == "add2"


def test_inside_weighted_multi_task_beside_a_local_agent():
    app = make_app()
    inference = ScriptedEndpoint(lambda prompt, i: answer_of(prompt) if "say a" in prompt else "0")
    multi = WeightedMultiTask([EchoAgent(env_id="echo", eval_size=4), remote(app, env_id="far")], [1, 1])

    groups = run(multi.group_rollouts(inference, 4, 2, ARGS))
    assert [g.rollouts[0].env_id for g in groups] == ["echo", "echo", "add2", "add2"]  # remote names kept
    assert all(r.is_valid for g in groups for r in g.rollouts)

    results = run(multi.evaluate(inference, 2, samples_per_prompt=2, ks=[1, 2], greedy=True))
    assert set(results) == {"echo", "far"}  # evaluation is reported under the local name
    assert results["far"].ks == [1, 2] and len(results["far"].results) == 2
    assert (
        evaluation_metrics(results["far"])["pass@2"] == 1.0
        and evaluation_metrics(results["echo"])["pass@1"] == 1.0
    )

    state = multi.state_dict()
    assert state["far"]["remote_env_id"] == "add2" and state["far"]["state"]["sampler"]["position"] == 2
    first = run(multi.group_rollouts(inference, 4, 2, ARGS))
    multi.load_state_dict(state)
    again = run(multi.group_rollouts(inference, 4, 2, ARGS))
    assert [g.model_dump() for g in again] == [g.model_dump() for g in first]


def test_built_from_config_with_the_runs_seed_and_env_id():
    multi = build_agents(
        [EnvironmentConfig(agent_type="remote", agent_args={"url": SERVER_URL, "remote_env_id": "add2"})],
        seed=9,
    )
    (agent,) = multi.agents
    assert isinstance(agent, RemoteAgent) and agent.env_id == "remote" and agent.remote_env_id == "add2"


def test_server_forwards_its_failure_counters():
    def reply(prompt, index):
        raise RuntimeError("inference down")

    agent = remote(make_app(factory=RecordingFactory(ScriptedEndpoint(reply))))
    groups = run(agent.group_rollouts(ScriptedEndpoint(), 2, 3))
    assert all(r.status == "placeholder" for g in groups for r in g.rollouts)
    assert agent.pop_metrics() == {"remote/add2/failures/inference": 2.0, "remote/add2/placeholders": 6.0}
    assert agent.pop_metrics() == {}


def refused(request):
    raise httpx.ConnectError("connection refused", request=request)


def too_slow(request):
    raise httpx.ReadTimeout("timed out", request=request)


def busy(request):
    return httpx.Response(503, json={"error": {"message": "busy"}})


@pytest.mark.parametrize("answer", [refused, too_slow, busy])
def test_a_server_that_stays_down_gives_placeholder_groups_and_counters(answer):
    mock, attempts = failing_transport(answer)
    agent = RemoteAgent(
        SERVER_URL, remote_env_id="add2", env_id="far", max_retries=2, backoff_s=0.01, transport=mock
    )
    start = time.monotonic()
    groups = run(agent.group_rollouts(ScriptedEndpoint(), 3, 2))
    assert time.monotonic() - start < 2.0 and len(attempts) == 3
    assert [g.group_id for g in groups] == [
        "far/remote-failed-0",
        "far/remote-failed-1",
        "far/remote-failed-2",
    ]
    assert all(r.status == "placeholder" and r.env_id == "far" for g in groups for r in g.rollouts)
    reason = groups[0].rollouts[0].failure_reason
    assert reason.startswith(f"unreachable: remote environment server {SERVER_URL} unreachable since ")
    assert "no answer after 3 attempt(s)" in reason
    assert all(failed_unreachable(r) for g in groups for r in g.rollouts)  # the batch check stops the run
    assert agent.pop_metrics() == {"failures/remote": 1.0, "placeholders": 6.0}
    later = run(agent.group_rollouts(ScriptedEndpoint(), 1, 2))
    assert later[0].group_id == "far/remote-failed-3"  # group ids stay unique across calls


def test_a_server_that_recovers_within_the_retries_answers_normally():
    app = make_app()
    inner = transport(app)

    class RecoversOnThirdTry(httpx.AsyncBaseTransport):
        tries = 0

        async def handle_async_request(self, request):
            self.tries += 1
            if self.tries < 3:
                raise httpx.ConnectError("not yet", request=request)
            return await inner.handle_async_request(request)

    agent = RemoteAgent(SERVER_URL, remote_env_id="add2", backoff_s=0.01, transport=RecoversOnThirdTry())
    groups = run(agent.group_rollouts(ScriptedEndpoint(), 2, 2))
    assert all(r.is_valid for g in groups for r in g.rollouts) and agent.pop_metrics() == {}


def test_a_refused_request_raises_at_once_with_the_servers_message():
    app = make_app()
    with pytest.raises(RemoteError, match=r"HTTP 404: unknown env_id 'nope'; this server has \['add2'"):
        run(remote(app, "nope").group_rollouts(ScriptedEndpoint(), 1, 2))
    with pytest.raises(RemoteError, match="HTTP 409: environment 'held' is evaluation-only"):
        run(remote(app, "held").group_rollouts(ScriptedEndpoint(), 1, 2))
    with pytest.raises(ValueError, match="group_size"):  # checked before it is sent
        run(remote(app).group_rollouts(ScriptedEndpoint(), 1, 1000))
    mock, attempts = failing_transport(lambda request: httpx.Response(400, text="plain refusal"))
    agent = RemoteAgent(SERVER_URL, remote_env_id="x", backoff_s=0.01, transport=mock)
    with pytest.raises(RemoteError, match="HTTP 400: plain refusal"):
        run(agent.group_rollouts(ScriptedEndpoint(), 1, 2))
    assert len(attempts) == 1


def test_inference_without_a_base_url_is_a_clear_error():
    agent = remote(make_app())
    with pytest.raises(ValueError, match=r"needs an HTTP inference interface \(inference.type: openai\)"):
        run(agent.group_rollouts(ScriptedInference("1"), 1, 2))
    factory = RecordingFactory()
    with_url = remote(make_app(factory=factory), inference_url="http://10.0.0.5:8000/v1")
    run(with_url.group_rollouts(ScriptedInference("1"), 1, 2))
    assert factory.endpoints[0].base_url == "http://10.0.0.5:8000/v1"


def test_state_round_trip_and_mismatched_state():
    agent = remote(make_app())
    state = agent.state_dict()
    first = run(agent.group_rollouts(ScriptedEndpoint(), 3, 2))
    agent.load_state_dict(state)
    again = run(agent.group_rollouts(ScriptedEndpoint(), 3, 2))
    assert [g.model_dump() for g in again] == [g.model_dump() for g in first]
    with pytest.raises(
        ValueError, match="saved state is for remote environment 'arithmetic', this agent targets 'add2'"
    ):
        agent.load_state_dict({"remote_env_id": "arithmetic", "state": state["state"]})
    with pytest.raises(
        RemoteError, match="could not restore the state of the remote environment: .*HTTP 422"
    ):
        agent.load_state_dict({"remote_env_id": "add2", "state": {"sampler": {}}})


def test_state_dict_of_an_unreachable_server_raises_naming_it():
    mock, _ = failing_transport(lambda request: httpx.Response(502))
    agent = RemoteAgent(SERVER_URL, remote_env_id="add2", max_retries=1, backoff_s=0.01, transport=mock)
    with pytest.raises(
        RemoteUnavailableError, match=f"could not save the state of .*GET {SERVER_URL}/v1/state"
    ):
        agent.state_dict()


def test_sync_calls_work_inside_a_running_event_loop():
    agent = remote(make_app())

    async def checkpoint_from_async_code():
        return agent.state_dict()

    assert run(checkpoint_from_async_code())["remote_env_id"] == "add2"


def test_check_problems_finds_the_remote_environment_or_fails_fast():
    single = make_app(make_config([ENVIRONMENTS[0]]))
    agent = RemoteAgent(SERVER_URL, transport=transport(single))
    agent.check_problems()
    assert agent.remote_env_id == "arithmetic"

    with pytest.raises(
        ValueError, match=r"serves \['arithmetic', 'add2', 'held'\]; set agent_args.remote_env_id"
    ):
        RemoteAgent(SERVER_URL, transport=transport(make_app())).check_problems()
    with pytest.raises(ValueError, match="has no environment 'nope'"):
        remote(make_app(), "nope").check_problems()

    mock, attempts = failing_transport(refused)
    down = RemoteAgent(SERVER_URL, remote_env_id="add2", backoff_s=5.0, transport=mock)
    with pytest.raises(
        RemoteUnavailableError, match=f"could not reach the remote environment: GET {SERVER_URL}/v1/info"
    ):
        down.check_problems()
    assert len(attempts) == 1  # no retries, no backoff


def test_without_remote_env_id_the_only_environment_is_used():
    agent = RemoteAgent(SERVER_URL, transport=transport(make_app(make_config([ENVIRONMENTS[0]]))))
    groups = run(agent.group_rollouts(ScriptedEndpoint(), 2, 2))
    assert {g.rollouts[0].env_id for g in groups} == {"arithmetic"}


def test_bearer_token_from_the_named_environment_variable(monkeypatch):
    app = make_app(api_key="s3cret")
    with pytest.raises(RemoteError, match="HTTP 401"):
        run(remote(app).group_rollouts(ScriptedEndpoint(), 1, 2))
    monkeypatch.setenv("ENV_SERVER_TOKEN", "s3cret")
    agent = remote(app, api_key_env="ENV_SERVER_TOKEN")
    assert len(run(agent.group_rollouts(ScriptedEndpoint(), 1, 2))) == 1
    with pytest.raises(ValueError, match="environment variable UNSET_TOKEN is not set"):
        remote(app, api_key_env="UNSET_TOKEN")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"url": "ftp://host"}, "url must be an http:// or https:// URL"),
        (
            {"url": SERVER_URL, "inference_url": "localhost:8000"},
            "inference_url must be an http:// or https:// URL",
        ),
        ({"url": SERVER_URL, "max_retries": -1}, "max_retries >= 0"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RemoteAgent(**kwargs)


def test_pass_at_k_wrapper_reports_the_callers_ks():
    agent = PassAtKAgent(remote(make_app()), n=4, ks=[1, 4], greedy=False)
    response = run(agent.evaluate(ScriptedEndpoint(), 2))
    assert (
        response.ks == [1, 4]
        and evaluation_metrics(response)["pass@4"] == 1.0
        and evaluation_metrics(response)["pass@1"] == 0.5
    )
