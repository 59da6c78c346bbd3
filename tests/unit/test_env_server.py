"""The environment server in process: its routes, request validation, auth, and problem order."""

import asyncio

import pytest
from env_server_helpers import (
    INFERENCE_URL,
    RecordingFactory,
    ScriptedEndpoint,
    acall,
    call,
    evaluate_body,
    make_app,
    make_config,
    problem_ids,
    rollouts_body,
)

from llmrl import cli
from llmrl.agents import evaluation_metrics
from llmrl.server import env_server
from llmrl.types import EvaluationResponse, RolloutGroup


def test_info_and_healthz_describe_the_environments():
    app = make_app()
    assert call(app, "GET", "/healthz").json() == {"status": "ok"}
    info = call(app, "GET", "/v1/info").json()
    by_id = {env["env_id"]: env for env in info["environments"]}
    assert list(by_id) == ["arithmetic", "add2", "held"]
    assert by_id["add2"] | {"num_train_problems": None} == {
        "env_id": "add2",
        "agent_type": "arithmetic",
        "weight": 3.0,
        "evaluation_only": False,
        "num_train_problems": None,
        "num_eval_problems": 6,
    }
    assert by_id["add2"]["num_train_problems"] > 7000 and by_id["held"]["evaluation_only"]
    assert "POST /v1/group_rollouts" in info["endpoints"] and "GET /v1/state" in info["endpoints"]


def test_group_rollouts_mix_training_environments_by_weight():
    factory = RecordingFactory()
    app = make_app(factory=factory)
    body = rollouts_body(num_groups=4, group_size=2, inference={"base_url": INFERENCE_URL, "model": "m"})
    reply = call(app, "POST", "/v1/group_rollouts", json=body)
    assert reply.status_code == 200
    groups = [RolloutGroup.model_validate(g) for g in reply.json()["groups"]]
    assert [g.rollouts[0].env_id for g in groups] == ["arithmetic", "add2", "add2", "add2"]  # weights 1:3
    assert all(g.rewards == [1.0, 0.0] for g in groups)  # sample 0 right, sample 1 off by one
    assert all(r.num_generated > 0 and r.flat_logprobs for g in groups for r in g.rollouts)
    assert [(e.base_url, e.model) for e in factory.endpoints] == [(INFERENCE_URL, "m")]


def test_group_rollouts_of_one_environment_and_its_counters():
    def reply(prompt, index):
        raise RuntimeError("inference is down")

    app = make_app(factory=RecordingFactory(ScriptedEndpoint(reply)))
    reply = call(app, "POST", "/v1/group_rollouts", json=rollouts_body(env_id="arithmetic", num_groups=3))
    groups = reply.json()["groups"]
    assert len(groups) == 3 and {g["rollouts"][0]["env_id"] for g in groups} == {"arithmetic"}
    assert all(r["status"] == "placeholder" for g in groups for r in g["rollouts"])
    assert reply.json()["metrics"] == {"arithmetic/failures/inference": 3.0, "arithmetic/placeholders": 6.0}


def test_evaluate_all_environments_or_one():
    app = make_app()
    results = call(app, "POST", "/v1/evaluate", json=evaluate_body(greedy=True)).json()["results"]
    assert set(results) == {"arithmetic", "add2", "held"}
    held = EvaluationResponse(env_id="held", results=results["held"], ks=[1, 2])
    metrics = evaluation_metrics(held)
    assert metrics == {
        "reward_mean": 0.5,
        "accuracy": 0.5,
        "pass@1": 0.5,
        "pass@2": 1.0,
        "greedy_accuracy": 1.0,
        "failed_samples": 0.0,
    }
    one = call(app, "POST", "/v1/evaluate", json=evaluate_body(env_id="add2", num_prompts=2)).json()[
        "results"
    ]
    assert list(one) == ["add2"] and len(one["add2"]) == 2


def test_state_round_trip_repeats_the_problem_order():
    app = make_app()
    saved = call(app, "GET", "/v1/state").json()
    first = call(app, "POST", "/v1/group_rollouts", json=rollouts_body(env_id="add2", num_groups=3)).json()
    restored = call(app, "POST", "/v1/state", json={"state": {"add2": saved["state"]["add2"]}})
    assert restored.status_code == 200 and restored.json() == {"state": {"add2": saved["state"]["add2"]}}
    again = call(app, "POST", "/v1/group_rollouts", json=rollouts_body(env_id="add2", num_groups=3)).json()
    assert problem_ids(again["groups"]) == problem_ids(first["groups"])


def test_a_state_that_does_not_fit_is_refused_and_changes_nothing():
    app = make_app()
    call(app, "POST", "/v1/group_rollouts", json=rollouts_body(num_groups=4))
    before = call(app, "GET", "/v1/state").json()["state"]
    good = before["arithmetic"] | {"groups_drawn": 0}
    bad = before["add2"] | {"sampler": before["add2"]["sampler"] | {"seed": 99}}
    reply = call(app, "POST", "/v1/state", json={"state": {"arithmetic": good, "add2": bad}})
    assert reply.status_code == 422
    assert (
        "state.add2: does not fit this environment: sampler state has seed=99"
        in reply.json()["error"]["message"]
    )
    assert call(app, "GET", "/v1/state").json()["state"] == before  # 'arithmetic' was rolled back too
    unknown = call(app, "POST", "/v1/state", json={"state": {"nope": {}}})
    assert unknown.status_code == 404


def test_agents_are_built_once_per_app(monkeypatch):
    calls = []
    real = env_server.build_agents
    monkeypatch.setattr(env_server, "build_agents", lambda *a, **k: calls.append(1) or real(*a, **k))
    app = make_app()
    first = call(app, "POST", "/v1/group_rollouts", json=rollouts_body(env_id="add2"))
    second = call(app, "POST", "/v1/group_rollouts", json=rollouts_body(env_id="add2"))
    call(app, "POST", "/v1/evaluate", json=evaluate_body())
    assert len(calls) == 1
    # The same sampler serves both calls: the order goes on instead of starting over.
    assert set(problem_ids(first.json()["groups"])).isdisjoint(problem_ids(second.json()["groups"]))


def test_problem_order_is_the_same_in_identical_apps_even_under_concurrent_calls():
    async def concurrently(app):
        body = rollouts_body(env_id="add2", num_groups=2)
        replies = await asyncio.gather(
            *(acall(app, "POST", "/v1/group_rollouts", json=body) for _ in range(3))
        )
        return [pid for reply in replies for pid in problem_ids(reply.json()["groups"])]

    def one_by_one(app):
        body = rollouts_body(env_id="add2", num_groups=2)
        return [
            pid
            for _ in range(3)
            for pid in problem_ids(call(app, "POST", "/v1/group_rollouts", json=body).json()["groups"])
        ]

    first, second = make_app(), make_app()
    drawn_together = asyncio.run(concurrently(first))
    drawn_in_turn = one_by_one(second)
    assert sorted(drawn_together) == sorted(drawn_in_turn) and len(set(drawn_in_turn)) == 6
    assert call(first, "GET", "/v1/state").json() == call(second, "GET", "/v1/state").json()
    assert one_by_one(make_app())[:6] == drawn_in_turn
    assert one_by_one(make_app(make_config(seed=4)))[:6] != drawn_in_turn


def test_calls_to_one_environment_run_one_at_a_time_and_different_environments_overlap():
    inference = ScriptedEndpoint()
    inference.delay_s = lambda prompt: 0.02
    app = make_app(factory=RecordingFactory(inference))

    async def together(*env_ids):
        bodies = [rollouts_body(env_id=env_id, num_groups=2) for env_id in env_ids]
        await asyncio.gather(*(acall(app, "POST", "/v1/group_rollouts", json=body) for body in bodies))

    asyncio.run(together("add2", "add2", "add2"))
    assert inference.max_in_flight == 2  # one call's two groups at a time
    asyncio.run(together("add2", "arithmetic"))
    assert inference.max_in_flight == 4


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/v1/group_rollouts", b"{not json", 422, "JSON decode error"),
        (
            "/v1/group_rollouts",
            rollouts_body(num_groups="many"),
            422,
            "body.num_groups: Input should be a valid integer",
        ),
        (
            "/v1/group_rollouts",
            rollouts_body(num_groups=10**9),
            422,
            "body.num_groups: Input should be less than or equal to 1024",
        ),
        (
            "/v1/group_rollouts",
            rollouts_body(group_size=-1),
            422,
            "body.group_size: Input should be greater than or equal to 1",
        ),
        (
            "/v1/group_rollouts",
            rollouts_body(plugins=["os"]),
            422,
            "body.plugins: Extra inputs are not permitted",
        ),
        (
            "/v1/group_rollouts",
            rollouts_body(agent_type="arithmetic"),
            422,
            "body.agent_type: Extra inputs are not permitted",
        ),
        (
            "/v1/group_rollouts",
            rollouts_body(inference={"base_url": "file:///etc/passwd"}),
            422,
            "body.inference.base_url",
        ),
        (
            "/v1/group_rollouts",
            rollouts_body(inference={"base_url": "http://u:pw@host/v1"}),
            422,
            "must not contain credentials",
        ),
        (
            "/v1/group_rollouts",
            rollouts_body(generation_args={"temperature": -1}),
            422,
            "body.generation_args.temperature",
        ),
        (
            "/v1/group_rollouts",
            rollouts_body(num_groups=1),
            422,
            "num_groups=1 is fewer than the 2 training environments",
        ),
        (
            "/v1/group_rollouts",
            rollouts_body(env_id="nope"),
            404,
            "unknown env_id 'nope'; this server has ['add2', 'arithmetic', 'held']",
        ),
        ("/v1/group_rollouts", rollouts_body(env_id="held"), 409, "'held' is evaluation-only"),
        ("/v1/evaluate", evaluate_body(ks=[1, 3]), 422, "ks must be in 1..samples_per_prompt (2), got [3]"),
        ("/v1/evaluate", evaluate_body(num_prompts=0), 422, "body.num_prompts"),
        ("/v1/evaluate", evaluate_body(env_id="nope"), 404, "unknown env_id 'nope'"),
        ("/v1/evaluate", {"num_prompts": 1}, 422, "body.inference: Field required"),
        ("/v1/state", {"state": {"add2": "x"}}, 422, "body.state.add2"),
        ("/v1/group_rollouts", b"x" * (2 << 20), 413, "over the limit"),
    ],
)
def test_malformed_requests_get_4xx_naming_the_problem_and_the_server_keeps_serving(
    path, body, status, message
):
    app = make_app()
    content = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    reply = call(app, "POST", path, **content)
    assert reply.status_code == status, reply.text
    assert message in reply.json()["error"]["message"]
    assert call(app, "POST", "/v1/group_rollouts", json=rollouts_body()).status_code == 200


def test_an_unexpected_error_is_a_500_and_the_server_keeps_serving():
    class FlakyFactory(RecordingFactory):
        def __call__(self, endpoint):
            if not self.endpoints:
                self.endpoints.append(endpoint)
                raise RuntimeError("boom")
            return super().__call__(endpoint)

    app = make_app(factory=FlakyFactory())
    reply = call(app, "POST", "/v1/group_rollouts", json=rollouts_body())
    assert reply.status_code == 500 and reply.json()["error"]["message"] == "RuntimeError: boom"
    assert call(app, "POST", "/v1/group_rollouts", json=rollouts_body()).status_code == 200


def test_bearer_token_is_required_on_every_route_when_configured():
    app = make_app(api_key="s3cret")
    for method, path, body in [
        ("GET", "/v1/info", None),
        ("POST", "/v1/group_rollouts", rollouts_body()),
        ("GET", "/healthz", None),
    ]:
        assert call(app, method, path, json=body).status_code == 401
        assert (
            call(app, method, path, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        )
        assert (
            call(app, method, path, json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        )


def test_plugins_come_from_the_local_config_only(monkeypatch):
    imported = []
    monkeypatch.setattr(env_server, "import_plugins", lambda modules: imported.append(list(modules)))
    config = make_config().model_copy(update={"plugins": ["my_envs"]})
    make_app(config)
    assert imported == [["my_envs"]]


def test_default_inference_factory_reuses_one_client_per_endpoint():
    pytest.importorskip("llmrl.inference.openai")
    factory = env_server.OpenAIEndpoints(api_key="k", timeout_s=5)
    endpoint = env_server.InferenceEndpoint(base_url=INFERENCE_URL, model="m")
    first = factory(endpoint)
    assert factory(env_server.InferenceEndpoint(base_url=INFERENCE_URL, model="m")) is first
    assert first.model == "m" and factory(endpoint.model_copy(update={"model": None})) is not first
    asyncio.run(factory.aclose())
    assert factory.interfaces == {}


def test_serve_env_reports_config_errors_and_exits_2(tmp_path, capsys, monkeypatch):
    assert cli.main(["serve-env", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    config = tmp_path / "env.yaml"
    config.write_text(
        "environments: [{agent_type: arithmetic}]\ninference: {api_key_env: UNSET_INFERENCE_TOKEN}\n"
    )
    monkeypatch.delenv("UNSET_INFERENCE_TOKEN", raising=False)
    assert cli.main(["serve-env", str(config)]) == 2
    assert "environment variable UNSET_INFERENCE_TOKEN is not set" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "serve-env",
                str(config),
                "--set",
                "inference.api_key_env=null",
                "--set",
                "environments.0.agent_type=os.system",
            ]
        )
        == 2
    )
    assert "unknown agent type 'os.system'" in capsys.readouterr().err


def test_the_inference_token_goes_only_to_allowlisted_urls():
    factory = env_server.OpenAIEndpoints(
        api_key="tok", token_urls=["http://Inference.test:80/v1/"], timeout_s=5
    )
    assert factory(env_server.InferenceEndpoint(base_url="http://inference.test:80"))._api_key == "tok"
    for elsewhere in (
        "http://attacker.test/v1",
        "https://inference.test:80/v1",
        "http://inference.test:81/v1",
    ):
        assert factory(env_server.InferenceEndpoint(base_url=elsewhere))._api_key is None, elsewhere


def test_requests_naming_an_inference_url_off_the_allowlist_are_refused():
    factory = RecordingFactory()
    app = make_app(factory=factory, inference_urls=[INFERENCE_URL])
    elsewhere = {"base_url": "http://attacker.test/v1"}
    for path, body in (("/v1/group_rollouts", rollouts_body()), ("/v1/evaluate", evaluate_body())):
        answer = call(app, "POST", path, json={**body, "inference": elsewhere})
        assert answer.status_code == 403 and "attacker.test" in answer.json()["error"]["message"]
    assert factory.endpoints == []  # never asked for an interface to the attacker's URL
    assert call(app, "POST", "/v1/group_rollouts", json=rollouts_body()).status_code == 200


def test_a_token_without_allowed_urls_is_a_config_error():
    with pytest.raises(env_server.ConfigError, match="no inference URL may receive it"):
        env_server.create_env_app(make_config(), inference_api_key="tok")
