"""The environment server as its own process (`python -m llmrl serve-env`), reached over a socket."""

import asyncio
from types import SimpleNamespace

import httpx
import pytest
import yaml
from servers import serving

from llmrl.agents import PassAtKAgent, evaluation_metrics
from llmrl.agents.remote import RemoteAgent
from llmrl.envs.arithmetic import ArithmeticAgent
from llmrl.inference.interface import Health
from llmrl.processes import free_port
from llmrl.types import GenerationArgs

pytestmark = pytest.mark.slow

TOKEN = "integration-token"
CONFIG = {
    "seed": 1,
    "inference": {"request_timeout_s": 30},
    "environments": [{"agent_type": "arithmetic", "agent_args": {"digits": 1, "eval_size": 4}}],
}


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "env.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


def test_env_server_process_validates_authenticates_and_serves_a_remote_agent(
    tmp_path, config_file, monkeypatch
):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serving(
        "llmrl",
        "serve-env",
        str(config_file),
        "--api-key",
        TOKEN,
        log_path=tmp_path / "env.log",
        headers=auth,
    ) as url:
        assert httpx.get(f"{url}/v1/info").status_code == 401
        info = httpx.get(f"{url}/v1/info", headers=auth).json()
        assert [env["env_id"] for env in info["environments"]] == ["arithmetic"]
        bad = httpx.post(f"{url}/v1/group_rollouts", headers=auth, json={"num_groups": -1, "plugins": ["os"]})
        assert bad.status_code == 422 and "body.plugins: Extra inputs are not permitted" in bad.text
        assert httpx.get(f"{url}/healthz", headers=auth).status_code == 200  # still serving

        monkeypatch.setenv("ENV_SERVER_TOKEN", TOKEN)
        agent = RemoteAgent(url, api_key_env="ENV_SERVER_TOKEN", env_id="far")
        agent.check_problems()
        assert agent.remote_env_id == "arithmetic"
        state = agent.state_dict()
        assert state["state"]["sampler"]["position"] == 0

        # Nothing listens at this inference URL: the server's own inference client gives up, the
        # environment turns the samples into placeholders, and the counters come back to the agent.
        address = f"http://127.0.0.1:{free_port()}/v1"
        nowhere = SimpleNamespace(health=lambda: Health(servers=(address,), shared_url=address))
        groups = _run(agent.group_rollouts(nowhere, 2, 2))
        assert [len(g.rollouts) for g in groups] == [2, 2]
        assert all(
            r.status == "placeholder" and "inference" in r.failure_reason for g in groups for r in g.rollouts
        )
        metrics = agent.pop_metrics()
        assert metrics["remote/arithmetic/failures/inference"] == 2 and "failures/remote" not in metrics


def test_remote_agent_with_the_real_inference_server(tmp_path, config_file, tiny_model_path):
    pytest.importorskip("llmrl.server.inference_server")
    from llmrl.inference.openai import OpenAIInterface

    model = ["--model", "tiny://arithmetic"]
    with (
        serving("llmrl", "serve-inference", *model, log_path=tmp_path / "inference.log") as inference_url,
        serving("llmrl", "serve-env", str(config_file), log_path=tmp_path / "env.log") as env_url,
    ):
        inference = OpenAIInterface(f"{inference_url}/v1")
        agent = RemoteAgent(env_url, remote_env_id="arithmetic")
        args = GenerationArgs(max_tokens=8, seed=5)

        groups = _run(agent.group_rollouts(inference, 2, 3, args))
        rollouts = [r for g in groups for r in g.rollouts]
        assert all(r.is_valid and r.num_generated > 0 for r in rollouts)
        assert all(len(r.flat_logprobs) == len(r.tokens) for r in rollouts)
        local = ArithmeticAgent(digits=1, eval_size=4, seed=1, env_id="arithmetic")
        local_groups = _run(local.group_rollouts(inference, 2, 3, args))
        assert [r.problem_id for g in groups for r in g.rollouts] == [
            r.problem_id for g in local_groups for r in g.rollouts
        ]

        response = _run(PassAtKAgent(agent, n=2, ks=[1, 2], greedy=True).evaluate(inference, 4))
        metrics = evaluation_metrics(response)
        assert len(response.results) == 4 and 0.0 <= metrics["pass@1"] <= metrics["pass@2"] <= 1.0
        assert "greedy_accuracy" in metrics


def _run(coroutine):
    return asyncio.run(coroutine)
