"""`agent_type: openenv` against a real OpenEnv server: an environment written with OpenEnv's server classes
in a plug-in module this file writes, served by OpenEnv's own app under uvicorn in a subprocess (the
agent's `serve:`), played by scripted model replies."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import textwrap
import time

import httpx
import pytest
from scripted_inference import COMPLETION_OFFSET, ScriptedInference, encode, render
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.http11 import Response

from llmrl import registry
from llmrl.agents.base import failed_unreachable
from llmrl.envs.openenv_env import MISSING_EXTRA, OpenEnvAgent, _unreachable
from llmrl.errors import EnvironmentUnavailableError, UserError
from llmrl.processes import free_port
from llmrl.rollouts import BatchChecks
from llmrl.types import ChatMessage

# Counts down from 2 + seed % 3: each step's reward is 1 when the reply names the number shown, 0.25
# otherwise; done at zero. A reply of "boom" makes the environment raise (the server answers an error).
ENVIRONMENT = """
    import re
    from openenv.core.client_types import StepResult
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server import Action, Environment, Observation, State, create_app


    class SayAction(Action):
        word: str


    class CountObservation(Observation):
        text: str


    class CountdownEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State()
            self.left = 0

        def reset(self, seed=None, episode_id=None, **kwargs):
            self.left = 2 + (seed or 0) % 3
            self._state = State(episode_id=episode_id, step_count=0)
            return CountObservation(text=f"count {self.left}")

        def step(self, action, timeout_s=None, **kwargs):
            if action.word == "boom":
                raise RuntimeError("the environment broke")
            self._state.step_count += 1
            reward = 1.0 if action.word == str(self.left) else 0.25
            self.left -= 1
            return CountObservation(text=f"count {self.left}", reward=reward, done=self.left == 0)

        @property
        def state(self):
            return self._state


    app = create_app(CountdownEnvironment, SayAction, CountObservation, max_concurrent_envs=64)


    class CountdownClient(EnvClient[SayAction, CountObservation, State]):
        def _step_payload(self, action):
            return action.model_dump()

        def _parse_result(self, payload):
            observation = CountObservation(**payload["observation"])
            return StepResult(observation=observation, reward=payload.get("reward"), done=payload["done"])

        def _parse_state(self, payload):
            return State(**payload)


    def make_app():
        return app


    def to_messages(observation):
        return [{"role": "user", "content": "Say the number. " + observation["text"]}]


    def to_action(completion):
        return {"word": completion.strip()}


    def broken_messages(observation):
        return observation["txet"]


    def broken_action(completion):
        return {"word": completion.split()[1]}
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The environment's module, imported as a config's plug-in (forgotten afterwards)."""
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "countdown_env.py").write_text(textwrap.dedent(ENVIRONMENT))
    saved = set(registry._plugin_modules)
    registry.import_plugins([str(folder / "countdown_env.py")])
    yield "countdown_env"
    registry._plugin_modules.clear()
    registry._plugin_modules.update(saved)
    sys.modules.pop("countdown_env", None)


@pytest.fixture(scope="module")
def server_url(plugin):
    """One server, started by an agent's `serve:`, that the other tests reach by `url:`."""
    agent = OpenEnvAgent(serve={"module": f"{plugin}:app"}, eval_size=2)
    agent.check_problems()
    yield agent.url
    agent._server.process.close()


def make_agent(url, **kwargs):
    kwargs.setdefault("observation_to_messages", "countdown_env:to_messages")
    kwargs.setdefault("completion_to_action", "countdown_env:to_action")
    return OpenEnvAgent(url=url, env_id="countdown", eval_size=2, num_problems=8, max_sessions=16, **kwargs)


def count_shown(prompt: str, index: int = 0) -> str:
    """The right reply: the last number the environment showed."""
    return prompt.rsplit("count ", 1)[1].split("\n")[0]


def draw(agent, groups, group_size, reply=count_shown):
    inference = ScriptedInference(reply)
    return asyncio.run(agent.group_rollouts(inference, groups, group_size)), inference


def start_of(problem_id: str) -> int:
    return 2 + int(problem_id.removeprefix("seed-")) % 3


def test_the_reward_is_the_sum_of_the_step_rewards_until_done(server_url):
    agent = make_agent(server_url, max_turns=8)
    groups, _ = draw(agent, 3, 2)
    for group in groups:
        start = start_of(group.rollouts[0].problem_id)
        for rollout in group.rollouts:
            assert rollout.is_valid, rollout.failure_reason
            assert rollout.reward == start  # every reply right: 1 per step, and done at zero
            assert sum(rollout.generation_mask[i][0] for i in range(len(rollout.trajectory))) == start
    assert agent.pop_metrics() == {}


def test_wrong_replies_earn_what_the_environment_gives_and_max_turns_ends_the_episode(server_url):
    agent = make_agent(server_url, max_turns=2)
    groups, _ = draw(agent, 4, 2, reply="7")
    for group in groups:
        for rollout in group.rollouts:
            assert rollout.is_valid, rollout.failure_reason
            assert len(rollout.trajectory) == 4  # two model turns, then max_turns ends it before done
            assert rollout.reward == pytest.approx(0.25 + 0.25)


def test_a_groups_episodes_share_the_problems_seed(server_url):
    agent = make_agent(server_url)
    groups, _ = draw(agent, 4, 3)
    for group in groups:
        firsts = {rollout.text[0] for rollout in group.rollouts}
        assert firsts == {f"user: Say the number. count {start_of(group.rollouts[0].problem_id)}"}
    assert agent.eval_problems == make_agent(server_url, seed=7).eval_problems  # the run's seed: not here
    assert agent.train_problems != make_agent(server_url, seed=7).train_problems
    assert not {p.id for p in agent.train_problems} & {p.id for p in agent.eval_problems}


def test_the_episode_is_one_token_sequence_continued_at_the_token_level(server_url):
    agent = make_agent(server_url, system_prompt="Count down.")
    (group,), inference = draw(agent, 1, 1)
    (rollout,) = group.rollouts
    start = start_of(rollout.problem_id)
    first = [
        ChatMessage(role="system", content="Count down."),
        ChatMessage(role="user", content=f"Say the number. count {start}"),
    ]
    expected_segments = [encode(render(first))]
    for left in range(start, 0, -1):
        expected_segments.append([ord(c) + COMPLETION_OFFSET for c in str(left)])
        if left > 1:
            expected_segments.append(
                encode(render([ChatMessage(role="user", content=f"Say the number. count {left - 1}")]))
            )
    assert rollout.trajectory == expected_segments
    assert rollout.generation_mask == [[i % 2 == 1] * len(s) for i, s in enumerate(expected_segments)]
    # Each follow-up request carries the exact ids so far and only the new message.
    for turn, request in enumerate(inference.requests[1:], start=1):
        assert request.prompt_token_ids == [t for s in expected_segments[: 2 * turn] for t in s]
        assert request.prompt == [ChatMessage(role="user", content=f"Say the number. count {start - turn}")]
    assert inference.requests[0].prompt_token_ids is None


def test_default_functions_use_the_single_text_fields_of_the_schema(server_url):
    agent = OpenEnvAgent(url=server_url, eval_size=2, num_problems=4, chat=False, max_sessions=4)
    groups, inference = draw(agent, 2, 2)
    assert all(r.is_valid and r.reward == start_of(r.problem_id) for g in groups for r in g.rollouts)
    assert isinstance(inference.requests[0].prompt, str) and inference.requests[0].prompt.startswith("count ")


def test_a_typed_client_gets_typed_observations_and_the_default_action_is_its_action_class(server_url):
    agent = OpenEnvAgent(url=server_url, client="countdown_env:CountdownClient", eval_size=2, num_problems=4)
    groups, _ = draw(agent, 2, 1)
    assert all(r.is_valid and r.reward == start_of(r.problem_id) for g in groups for r in g.rollouts)
    assert type(agent.completion_to_action("3")).__name__ == "SayAction"


def test_the_app_factory_of_a_plugin_is_served(plugin):
    agent = OpenEnvAgent(serve={"module": f"{plugin}:make_app"}, eval_size=2, num_problems=4, max_sessions=4)
    try:
        groups, _ = draw(agent, 1, 2)
        assert all(r.is_valid for r in groups[0].rollouts)
        assert agent._server.factory
    finally:
        agent._server.process.close()


def test_an_environment_server_that_is_down_at_the_start_stops_the_run_to_be_rerun(plugin, caplog):
    url = f"http://127.0.0.1:{free_port()}"
    agent = make_agent(url)
    with pytest.raises(EnvironmentUnavailableError) as failure:
        agent.check_problems()
    line = str(failure.value)
    assert re.fullmatch(
        rf"countdown: openenv server {url} unreachable since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d: "
        r"ConnectError: .*; rerun the same command once it answers",
        line,
    ), line
    with caplog.at_level(logging.WARNING):
        (group,), _ = draw(agent, 1, 2)
    assert all(failed_unreachable(r) for r in group.rollouts)
    assert group.rollouts[0].failure_reason.startswith(
        f"unreachable: openenv server {url} unreachable since "
    )
    assert agent.pop_metrics() == {"failures/unreachable": 1.0, "placeholders": 2.0}
    assert caplog.text.count(f"countdown: unreachable: openenv server {url}") == 1


def test_a_server_killed_mid_episode_fails_every_episode_as_unreachable_and_the_batch_stops_the_run(plugin):
    agent = OpenEnvAgent(
        serve={"module": f"{plugin}:app"},
        env_id="countdown",
        observation_to_messages="countdown_env:to_messages",
        completion_to_action="countdown_env:to_action",
        eval_size=2,
        num_problems=8,
        max_sessions=1,  # one episode after the other: the first is in its session when the server dies
    )
    agent.check_problems()
    server = agent._server.process

    def reply_then_kill(prompt, index):
        if server.process is not None and server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
        return count_shown(prompt)

    try:
        groups, _ = draw(agent, 2, 2, reply=reply_then_kill)
    finally:
        server.close()
    rollouts = [r for g in groups for r in g.rollouts]
    assert all(failed_unreachable(r) for r in rollouts), [r.failure_reason for r in rollouts]
    # The first episode lost its session's connection; the others found no server to connect to.
    assert "ConnectionClosedError" in rollouts[0].failure_reason
    assert all("ConnectionError: Failed to connect" in r.failure_reason for r in rollouts[1:])
    since = {r.failure_reason.split(" unreachable since ")[1][:19] for r in rollouts}
    assert len(since) == 1  # the time the server was first found down, not each episode's
    assert agent.pop_metrics() == {"failures/unreachable": 4.0, "placeholders": 4.0}

    refusal = BatchChecks(ScriptedInference("1"), None, 0.5).refusal(3, groups, time.time())
    assert isinstance(refusal, EnvironmentUnavailableError)
    assert str(refusal).startswith(f"countdown: openenv server {agent.url} unreachable since {since.pop()}: ")
    assert str(refusal).endswith(
        "(batch of step 3: 4 of 4 rollouts could not reach it); nothing from it was trained on or kept; "
        "rerun the same command to resume"
    )


def handshake_refused(status: int) -> ConnectionError:
    """What OpenEnv's client raises when the server answers its WebSocket handshake with `status`."""
    refusal = InvalidStatus(Response(status, "", Headers()))
    try:
        raise ConnectionError(f"Failed to connect to ws://h/ws: {refusal}") from refusal
    except ConnectionError as error:
        return error


def http_status(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "http://h/schema")
    return httpx.HTTPStatusError("", request=request, response=httpx.Response(status, request=request))


@pytest.mark.parametrize(
    ("error", "unreachable"),
    [
        (ConnectionRefusedError(111, "Connection refused"), True),
        (handshake_refused(502), True),  # a proxy in front of a server that is down
        (handshake_refused(503), True),
        (handshake_refused(404), False),  # no OpenEnv server at that URL: rerunning will not help
        (ConnectionClosedError(None, None), True),  # the server died during the session
        (TimeoutError(), True),
        (httpx.ConnectError("refused"), True),
        (httpx.ReadTimeout("no answer"), True),
        (http_status(500), True),
        (http_status(404), False),
        # What the server answers when the environment raised on this episode, or refused the session.
        (RuntimeError("Server error: the environment broke (code: EXECUTION_ERROR)"), False),
        (RuntimeError("Server error: Server at capacity (code: CAPACITY_REACHED)"), False),
        (ValueError("a step's reward 'x' is not a finite number"), False),
    ],
)
def test_an_unreachable_server_is_told_apart_from_one_that_answers_with_an_error(error, unreachable):
    assert _unreachable(error) is unreachable


def test_an_environment_that_answers_with_an_error_fails_only_its_episode(server_url):
    agent = make_agent(server_url)
    groups, _ = draw(
        agent,
        2,
        2,
        reply=lambda prompt, index: (
            "boom" if prompt.startswith("<user>Say the number. count 3") else count_shown(prompt)
        ),
    )
    failed = 0
    for group in groups:
        for rollout in group.rollouts:
            if start_of(rollout.problem_id) == 3:
                assert rollout.failure_reason.startswith(
                    f"environment: openenv server {server_url}: RuntimeError: "
                )
                assert "the environment broke" in rollout.failure_reason
                assert not failed_unreachable(rollout)  # the server answered: the run goes on
                failed += 1
            else:
                assert rollout.is_valid
    assert failed > 0
    assert agent.pop_metrics() == {"failures/environment": float(failed), "placeholders": float(failed)}


@pytest.mark.parametrize(
    "function, line, name",
    [
        ("observation_to_messages", "broken_messages", "KeyError: 'txet'"),
        ("completion_to_action", "broken_action", "IndexError"),
    ],
)
def test_a_user_function_that_raises_is_named_at_its_line(server_url, function, line, name):
    agent = make_agent(server_url, **{function: f"countdown_env:{line}"})
    (group,), _ = draw(agent, 1, 2)
    source = textwrap.dedent(ENVIRONMENT).splitlines()
    line_number = next(i for i, text in enumerate(source, start=1) if f"def {line}(" in text) + 1
    for rollout in group.rollouts:
        # A plug-in outside the working directory is named by its whole path.
        assert rollout.failure_reason.startswith("observe: /")
        assert f"/countdown_env.py:{line_number} in {line}: {name}" in rollout.failure_reason
    assert agent.pop_metrics() == {"failures/observe": 2.0, "placeholders": 2.0}


def test_a_function_that_returns_no_messages_is_named_at_its_definition(server_url, monkeypatch):
    def nothing(observation):
        return 42

    agent = make_agent(server_url, observation_to_messages=nothing)
    (group,), _ = draw(agent, 1, 1)
    assert "nothing: returned 42; expected a string" in group.rollouts[0].failure_reason


def test_mistakes_in_the_arguments_name_the_field(plugin):
    with pytest.raises(
        ValueError, match="serve.module: 'no_such_module:app': module 'no_such_module' is not a plug-in"
    ):
        OpenEnvAgent(serve={"module": "no_such_module:app"})
    with pytest.raises(ValueError, match="countdown_env' has no function 'nope'"):
        OpenEnvAgent(serve={"module": f"{plugin}:nope"})
    with pytest.raises(ValueError, match="give either url"):
        OpenEnvAgent(url="http://127.0.0.1:1", serve={"module": f"{plugin}:app"})
    with pytest.raises(ValueError, match="url: expected http://host:port"):
        OpenEnvAgent(url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="client: .* is not an OpenEnv EnvClient class"):
        OpenEnvAgent(url="http://127.0.0.1:1", client=f"{plugin}:to_action")


def test_without_the_extra_the_agent_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(UserError) as failure:
        OpenEnvAgent(url="http://127.0.0.1:1")
    assert (
        str(failure.value)
        == MISSING_EXTRA
        == "agent_type openenv needs the openenv extra: pip install 'llmrl[openenv]'"
    )


def test_the_agent_is_registered():
    assert registry.get_agent_class("openenv") is OpenEnvAgent


def test_evaluation_plays_the_held_out_seeds(server_url):
    agent = make_agent(server_url)
    inference = ScriptedInference(count_shown)
    evaluation = asyncio.run(agent.evaluate(inference, 2, samples_per_prompt=2, greedy=True))
    assert [result.problem_id for result in evaluation.results] == [p.id for p in agent.eval_problems]
    for result in evaluation.results:
        assert result.rewards == [start_of(result.problem_id)] * 2 == [result.greedy_reward] * 2
