"""LLM judges as reward entries (`llmrl.inference.judge`): the template and the parsers, requests in
parallel under the judge's limit, retries, the cache, failures counted and never scored 0, the
policy's own inference as the judge, and llmrl's server and engine as real judges."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
from scripted_inference import ScriptedInference
from test_reward_functions_batched import ROWS, Plugin, agent, draw, right_then_wrong

from llmrl.agents.dataset import DatasetAgent
from llmrl.inference.engine import LocalEngine
from llmrl.inference.judge import DEFAULT_TEMPLATE, Judge, JudgeSettings, judge_reward_function
from llmrl.rewards.functions import Sample
from llmrl.server.inference_server import create_inference_app
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest

GRADING = re.compile(r"Reference answer:\n(.*)\n\nResponse:\n(.*)\n\nDoes", re.DOTALL)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return str(path)


class FakeJudgeServer:
    """An OpenAI-compatible chat endpoint (httpx's mock transport) grading as a perfect judge would:
    CORRECT when the response is the reference answer. `fail_first` answers fail with 500 first;
    `delay_s` holds each answer; `reply` replaces the grade."""

    def __init__(
        self, *, fail_first: int = 0, delay_s: float = 0.0, reply: str | None = None, status: int = 500
    ):
        self.bodies: list[dict] = []
        self.fail_first = fail_first
        self.delay_s = delay_s
        self.reply = reply
        self.status = status
        self.in_flight = self.most_in_flight = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "grader"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.fail_first > 0:
            self.fail_first -= 1
            return httpx.Response(self.status, json={"error": {"message": "judge overloaded"}})
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        reference, response = GRADING.search(body["messages"][-1]["content"]).groups()
        grade = self.reply or ("I checked: CORRECT" if reference == response else "It is INCORRECT.")
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": grade}}]})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


def judged(data_file, server: FakeJudgeServer, **settings) -> DatasetAgent:
    """The sums agent whose one reward is a judge behind `server`."""
    scoring = agent(data_file)
    entry = {"judge": {"url": "http://judge/v1", "max_retries": 0, **settings}, "weight": 2.0}
    scoring.reward_functions = [
        judge_reward_function(entry, "reward_functions[0]", transport=server.transport())
    ]
    return scoring


def test_a_verdict_judge_grades_each_completion_against_the_reference(data_file):
    server = FakeJudgeServer()
    groups = draw(judged(data_file, server), 2, 4)
    for group in groups:
        assert [r.reward for r in group.rollouts] == [2.0, 0.0, 2.0, 0.0]  # weight 2
        assert [r.reward_components for r in group.rollouts] == [{"judge": 1.0}, {"judge": 0.0}] * 2
    body = server.bodies[0]
    assert body["model"] == "grader" and body["temperature"] == 0.0 and body["max_tokens"] == 256
    (message,) = body["messages"]
    question = re.search(r"Question:\n(.*)\n\nReference", message["content"]).group(1)
    assert re.fullmatch(r"What is 2 \+ \d+\?", question)
    assert len(server.bodies) == 4  # two distinct completions per group, each asked once


def test_the_cache_asks_once_per_prompt_and_completion(data_file):
    server = FakeJudgeServer()
    scoring = judged(data_file, server)
    first = draw(scoring, 1, 4)
    asked = len(server.bodies)
    assert asked == 2  # samples 0 and 2 (and 1 and 3) are the same completion of the same prompt
    assert scoring.pop_metrics() == {"judge/requests": 2.0, "judge/cache_hits": 2.0}
    judge = scoring.reward_functions[0].judge
    sample = Sample(prompt=first[0].rollouts[0].text[0], completion="9", completion_ids=[], ground_truth="9")
    asyncio.run(judge.grade(sample, None))
    asyncio.run(judge.grade(sample, None))
    assert len(server.bodies) == asked + 1
    uncached = judged(data_file, server, cache_size=0).reward_functions[0].judge
    asyncio.run(uncached.grade(sample, None))
    asyncio.run(uncached.grade(sample, None))
    assert len(server.bodies) == asked + 3


@pytest.mark.parametrize(("limit", "least_s", "most_s"), [(16, 0.1, 0.5), (1, 1.6, 3.0)])
def test_requests_run_in_parallel_up_to_max_concurrent(data_file, limit, least_s, most_s):
    server = FakeJudgeServer(delay_s=0.1)
    scoring = judged(data_file, server, max_concurrent=limit, cache_size=0)
    completions = [str(i) for i in range(16)]
    samples = [
        Sample(prompt="What is 2 + 2?", completion=c, completion_ids=[], ground_truth="4")
        for c in completions
    ]
    started = time.perf_counter()
    grades = asyncio.run(scoring.reward_functions[0].judge.grade_group(samples, None))
    elapsed = time.perf_counter() - started
    assert [value for value, _ in grades] == [float(c == "4") for c in completions]
    assert server.most_in_flight == limit
    assert least_s <= elapsed < most_s, elapsed


def test_a_failing_request_is_retried_then_fails_its_rollout_named_never_zero(data_file):
    server = FakeJudgeServer(fail_first=1)
    scoring = judged(data_file, server, max_retries=1, cache_size=0)
    (group,) = draw(scoring, 1, 2)
    assert [r.reward for r in group.rollouts] == [2.0, 0.0]
    assert len(server.bodies) == 3  # one retried

    down = FakeJudgeServer(fail_first=100)
    scoring = judged(data_file, down, max_retries=2)
    (group,) = draw(scoring, 1, 2)
    assert all(r.status == "placeholder" for r in group.rollouts)
    reason = group.rollouts[0].failure_reason
    assert reason.startswith(
        "reward: reward_functions[0].judge (http://judge/v1): HTTP 500: judge overloaded"
    ), reason
    assert len(down.bodies) == 2 * 3
    assert scoring.pop_metrics()["failures/reward"] == 2

    refused = FakeJudgeServer(fail_first=100, status=401)
    (group,) = draw(judged(data_file, refused, max_retries=2), 1, 2)
    assert "HTTP 401" in group.rollouts[0].failure_reason and len(refused.bodies) == 2  # not retried


@pytest.mark.parametrize(
    ("settings", "reply", "value"),
    [
        ({}, "<think>CORRECT? no.</think> incorrect", 0.0),
        ({}, "Not CORRECT... wait, it is correct", 1.0),
        ({"verdicts": {"A": 1.0, "B": 0.5, "C": 0.0}}, "Between A and C I pick B.", 0.5),
        ({"parser": "score"}, "Score: 7 out of 10? No: 8", 8.0),
        ({"parser": "score", "score_range": [0, 10]}, "Score: 7", 0.7),
        (
            {"parser": "score", "score_pattern": r"Score: (\d+)/5", "score_range": [1, 5]},
            "2/5 then Score: 4/5",
            0.75,
        ),
    ],
)
def test_parsers(data_file, settings, reply, value):
    judge = judged(data_file, FakeJudgeServer(reply=reply), **settings).reward_functions[0].judge
    assert judge._value(reply) == value


@pytest.mark.parametrize(
    ("settings", "reply", "cause"),
    [
        ({}, "I cannot tell.", "names none of the verdicts ['CORRECT', 'INCORRECT']: 'I cannot tell.'"),
        ({"parser": "score"}, "good", "has no number matching"),
        (
            {"parser": "score", "score_range": [0, 10]},
            "Score: 11",
            "its score 11 is outside score_range [0, 10]",
        ),
    ],
)
def test_an_answer_that_cannot_be_read_fails_its_rollout(data_file, settings, reply, cause):
    scoring = judged(data_file, FakeJudgeServer(reply=reply), **settings)
    (group,) = draw(scoring, 1, 2)
    assert all(r.status == "placeholder" for r in group.rollouts)
    assert cause in group.rollouts[0].failure_reason
    assert scoring.pop_metrics()["failures/reward"] == 2


def test_a_plugin_parser_and_its_failures_at_the_users_line(tmp_path, data_file):
    source = "def stars(text):\n    if 'skip' in text:\n        return None\n    return text.count('*') / 0 if '!' in text else text.count('*')\n"
    plugin = Plugin(tmp_path, "judge_parsers", source)
    judge = judged(data_file, FakeJudgeServer(), parser="judge_parsers:stars").reward_functions[0].judge
    assert judge._value("***") == 3.0 and judge._value("skip") is None
    with pytest.raises(
        Exception, match=rf"judge_parsers.py:{plugin.line('/ 0')} in stars: ZeroDivisionError"
    ):
        judge._value("*!")


def test_the_policy_itself_judges_when_no_server_is_named(data_file):
    def reply(prompt: str, index: int) -> str:
        if "Reference answer" in prompt:
            reference, response = GRADING.search(prompt).groups()
            return "CORRECT" if reference == response else "INCORRECT"
        return right_then_wrong(prompt, index)

    policy = ScriptedInference(reply)
    scoring = agent(data_file)
    entry = {"judge": {"max_tokens": 8, "system_prompt": "You grade."}}
    scoring.reward_functions = [judge_reward_function(entry, "reward_functions[0]")]
    (group,) = draw(scoring, 1, 4, policy)
    assert [r.reward for r in group.rollouts] == [1.0, 0.0, 1.0, 0.0]
    asked = [r for r in policy.requests if not isinstance(r.prompt, str)]
    assert len(asked) == 2
    assert [m.role for m in asked[0].prompt] == ["system", "user"]
    assert asked[0].generation_args.temperature == 0.0 and asked[0].generation_args.max_tokens == 8


def arithmetic_judge_settings() -> dict:
    """A judge the tiny arithmetic model can be: it is asked the question and its number read."""
    return {"template": "{question}{completion}", "parser": "score", "max_tokens": 6}


def test_llmrls_server_and_engine_judge_as_their_own_answers_say(tiny_model):
    model, tokenizer = tiny_model
    engine = LocalEngine(model, tokenizer)
    sample = Sample(
        prompt=[{"role": "user", "content": "What is 12 + 30?"}], completion=" ", completion_ids=[]
    )
    transport = httpx.ASGITransport(create_inference_app(engine, model_name="tiny"))
    served = Judge(
        JudgeSettings(**arithmetic_judge_settings()),
        "reward_functions[0]",
        base_url="http://tiny",
        transport=transport,
    )
    policy = Judge(JudgeSettings(**arithmetic_judge_settings()), "reward_functions[0]")
    request = InferenceRequest(
        prompt=[ChatMessage(role="user", content="What is 12 + 30? ")],
        generation_args=GenerationArgs(temperature=0.0, max_tokens=6),
    )
    (answer,) = engine.generate(request)
    number = float(re.findall(r"[-+]?\d+(?:\.\d+)?", answer.text)[-1])
    assert asyncio.run(served.grade(sample, None)) == (number, {})
    assert asyncio.run(policy.grade(sample, engine)) == (number, {})


def test_a_judge_llmrl_serves_grades_as_that_models_answers_say(tiny_model):
    model, tokenizer = tiny_model
    entry = {"judge": {"serve": {"model": "tiny://arithmetic"}, **arithmetic_judge_settings()}}
    reward = judge_reward_function(entry, "reward_functions[0]")
    try:
        assert reward.judge.base_url == reward.judge.server.base_url
        sample = Sample(
            prompt=[{"role": "user", "content": "What is 12 + 30?"}], completion=" ", completion_ids=[]
        )
        request = InferenceRequest(
            prompt=[ChatMessage(role="user", content="What is 12 + 30? ")],
            generation_args=GenerationArgs(temperature=0.0, max_tokens=6),
        )
        (answer,) = LocalEngine(model, tokenizer).generate(request)
        number = float(re.findall(r"[-+]?\d+(?:\.\d+)?", answer.text)[-1])
        assert asyncio.run(reward.judge.grade(sample, None)) == (number, {})
    finally:
        reward.judge.server.close()
    assert not reward.judge.server.alive()


@pytest.mark.parametrize(
    ("judge", "message"),
    [
        ({"temprature": 0}, "reward_functions[0].judge.temprature: Extra inputs are not permitted"),
        ({"template": "Grade {question}"}, "never shows the judge the completion; put {completion} in it"),
        ({"template": "{completion"}, "no str.format template"),
        ({"model": "gpt"}, "model and api_key_env belong to url"),
        (
            {"url": "http://judge", "serve": {"model": "tiny://arithmetic"}},
            "give url (a server you run) or serve",
        ),
        ({"parser": "score", "score_range": [5, 1]}, "low < high"),
        ({"score_pattern": "("}, "not a regular expression"),
        ({"verdicts": {"yes": 1, "YES": 0}}, "distinct words"),
        (
            {"parser": "nowhere:parse"},
            "reward_functions[0].judge.parser: expected verdict, score or a plug-in",
        ),
        ({"url": "http://judge", "api_key_env": "LLMRL_NO_SUCH_KEY"}, "LLMRL_NO_SUCH_KEY is not set"),
    ],
)
def test_a_bad_entry_is_one_line_naming_the_field(judge, message):
    with pytest.raises(ValueError) as raised:
        judge_reward_function({"judge": judge}, "reward_functions[0]")
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_template_field_the_data_lacks_is_refused_before_training(data_file):
    with pytest.raises(ValueError, match=r"uses \{difficulty\}, which is neither"):
        agent(data_file, {"judge": {"template": "{difficulty}: {completion}"}})
    assert agent(data_file, {"judge": {"template": "{topic}: {question} {completion} {solution}"}})


def test_the_default_template_shows_question_answer_and_completion():
    assert {"question", "answer", "completion"} <= set(re.findall(r"\{(\w+)\}", DEFAULT_TEMPLATE))
