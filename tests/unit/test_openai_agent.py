"""Agent programs (`openai_agent`): the endpoint's rendering, tool calls, sequences, masks and failures.

A scripted inference interface answers with crafted text over the tiny model's tokenizer, rendered
with a Hermes/Qwen-style tool template written for the tests (tests/fixtures).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import types
from pathlib import Path

import openai
import pytest

from llmrl.agents.openai_agent import OpenAIAgent
from llmrl.agents.tool_parsers import ParsedToolCall, parse_hermes
from llmrl.config import AlgorithmConfig
from llmrl.inference.openai import InferenceServerError, UnsupportedServerError
from llmrl.registry import import_plugins
from llmrl.rollouts import prepare_batch
from llmrl.types import GenerationArgs, InferenceRequest, InferenceResponse

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "hermes_tool_template.jinja"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    }
]
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class CraftedInference:
    """Completions are `script(call_index, prompt_text)`, tokenised, then eos; logprob -0.5 per token."""

    def __init__(self, tokenizer, script):
        self.tokenizer = tokenizer
        self.script = script
        self.requests: list[InferenceRequest] = []

    async def agenerate(self, request: InferenceRequest) -> list[InferenceResponse]:
        assert request.prompt == "" and request.prompt_token_ids, "the endpoint sends exact prompt ids"
        index = len(self.requests)
        self.requests.append(request)
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        responses = []
        for _ in range(request.n):
            text = self.script(index, prompt)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            responses.append(
                InferenceResponse(
                    text=text,
                    prompt_token_ids=request.prompt_token_ids,
                    token_ids=ids,
                    logprobs=[-0.5] * len(ids),
                    finish_reason="stop",
                    policy_version=3,
                )
            )
        return responses


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """A plug-in module of test programs, imported as a config's `plugins:` would."""
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "test_programs.py").write_text(PROGRAMS)
    import_plugins([str(folder / "test_programs.py")])
    yield sys.modules["test_programs"]


PROGRAMS = """
import asyncio
import json
import openai

TOOLS = json.loads(TOOLS_JSON)

async def tool_use(client, problem):
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": problem["question"]}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", first
    (call,) = message.tool_calls
    arguments = json.loads(call.function.arguments)
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])}]
    second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    return {"reward": float("5" in second.choices[0].message.content), "calls": 2.0}

async def two_conversations(client, problem):
    for question in ("first?", "second?"):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}])
    return 0.5

async def with_penalty(client, problem):
    try:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], presence_penalty=0.5
        )
    except openai.BadRequestError:
        return 1.0
    return 0.0

async def raises(client, problem):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the program broke")

async def thinks_long(client, problem):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    await asyncio.sleep(0.5)
    return 1.0

def not_async(client, problem):
    return 1.0

async def calls_forever(client, problem):
    while True:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
""".replace("TOOLS_JSON", repr(json.dumps(TOOLS)))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "problems.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is 2 + {i}?"}) + "\n" for i in range(8)))
    return str(path)


def make_agent(programs, data_file, rollout, **options) -> OpenAIAgent:
    del programs  # imported: the agent may name its functions
    return OpenAIAgent(
        rollout=f"test_programs:{rollout}",
        model_spec="tiny://arithmetic",
        chat_template=str(TEMPLATE),
        tool_parser="hermes",
        data_files=data_file,
        eval_size=2,
        env_id="programs",
        **options,
    )


def draw(agent, inference, group_size=1):
    (group,) = asyncio.run(agent.group_rollouts(inference, 1, group_size, GenerationArgs(max_tokens=64)))
    return group


# ---- tool-call parsing ----------------------------------------------------------------------------


def test_hermes_parser_reads_tool_calls_after_content():
    parsed = parse_hermes(f'Let me add.\n{ADD_CALL}\n<tool_call>{{"name": "now"}}</tool_call>')
    assert parsed.content == "Let me add."
    assert parsed.tool_calls == [ParsedToolCall("add", {"a": 2, "b": 3}), ParsedToolCall("now", {})]


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 5.",
        '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>',  # cut-off JSON
        '<tool_call>["add"]</tool_call>',  # not an object
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "add", "arguments": "a=2"}</tool_call>',  # arguments not an object
        f"{ADD_CALL}<tool_call>{{oops}}</tool_call>",  # one bad block spoils the completion
    ],
)
def test_hermes_parser_leaves_anything_else_as_content(text):
    assert parse_hermes(text).content == text and parse_hermes(text).tool_calls == []


def test_tool_only_completion_has_no_content():
    assert parse_hermes(ADD_CALL).content is None


# ---- rendering, tool calls and loss masks -------------------------------------------------------------


def test_tool_episode_is_one_sequence_with_the_tool_response_masked_out(programs, data_file):
    agent = make_agent(programs, data_file, "tool_use")
    inference = CraftedInference(agent.tokenizer, lambda i, prompt: ADD_CALL if i == 0 else "The sum is 5.")
    (rollout,) = draw(agent, inference).rollouts
    assert rollout.status == "ok", rollout.failure_reason
    assert rollout.reward == 1.0 and rollout.reward_components == {"calls": 2.0}
    assert rollout.extra_sequences == [], "the second call extends the first"
    first, second = inference.requests
    decode = agent.tokenizer.decode
    # tools= reached the template; the tool call and the tool's answer were rendered by it
    first_prompt = decode(first.prompt_token_ids)
    assert first_prompt.index('"name": "add"') < first_prompt.index("<|im_start|>user")
    assert "<tool_response>\n5\n</tool_response>" in decode(second.prompt_token_ids)
    # prompt (masked), the sampled call (trained), the tool turn (masked), the answer (trained)
    assert [all(m) for m in rollout.generation_mask] == [False, True, False, True]
    assert not any(any(m) for m in rollout.generation_mask[::2])
    completion_ids = [list(r.token_ids) for r in asyncio.run(_replay(inference))]
    assert rollout.trajectory[1] == completion_ids[0] and rollout.trajectory[3] == completion_ids[1]
    # the second prompt holds the first completion's sampled ids as they were, not re-tokenised text
    assert (
        second.prompt_token_ids[: len(rollout.tokens) - len(rollout.trajectory[3])]
        == rollout.tokens[: -len(rollout.trajectory[3])]
    )
    assert rollout.logprobs[1] == [-0.5] * len(rollout.trajectory[1])
    assert rollout.logprobs[2] == [0.0] * len(rollout.trajectory[2])
    assert rollout.policy_version == 3


async def _replay(inference):
    """The completions the crafted interface gave, recomputed from its recorded requests."""
    replay = CraftedInference(inference.tokenizer, inference.script)
    return [(await replay.agenerate(r))[0] for r in inference.requests]


def test_calls_that_do_not_extend_start_sequences_of_the_same_episode(programs, data_file):
    agent = make_agent(programs, data_file, "two_conversations")
    inference = CraftedInference(agent.tokenizer, lambda i, prompt: f"reply {i}")
    group = draw(agent, inference, group_size=2)
    rollout = group.rollouts[0]
    assert rollout.status == "ok" and len(rollout.sequences) == 2
    for sequence in rollout.sequences:
        assert [all(m) for m in sequence.generation_mask] == [False, True]
        assert sequence.reward == 0.5
    assert "second?" in agent.tokenizer.decode(rollout.trajectory[0])  # the last call's sequence comes first
    # every sequence of an episode trains with the episode's advantage
    rollouts = list(group.rollouts)
    rollouts[1] = rollouts[1].model_copy(update={"reward": 0.0})
    batch, advantages = prepare_batch(
        [group.model_copy(update={"rollouts": rollouts})],
        group_size=2,
        algorithm=AlgorithmConfig(),
        max_tokens=64,
    )
    assert len(batch) == 4
    assert batch.advantages.tolist() == [advantages[0].item()] * 2 + [advantages[1].item()] * 2


# ---- refusals, failures and limits --------------------------------------------------------------------


def test_penalties_are_refused_in_training_and_accepted_in_evaluation(programs, data_file):
    agent = make_agent(programs, data_file, "with_penalty")
    inference = CraftedInference(agent.tokenizer, lambda i, prompt: "ok")
    (rollout,) = draw(agent, inference).rollouts
    assert rollout.status == "placeholder" and "no model call" in rollout.failure_reason
    assert inference.requests == []
    evaluation = asyncio.run(agent.evaluate(inference, 1, generation_args=GenerationArgs(max_tokens=8)))
    assert evaluation.results[0].rewards == [0.0]  # the penalty was accepted: no BadRequestError
    assert inference.requests[0].generation_args.presence_penalty == 0.5


def test_a_program_that_raises_becomes_a_counted_placeholder(programs, data_file):
    agent = make_agent(programs, data_file, "raises")
    inference = CraftedInference(agent.tokenizer, lambda i, prompt: "ok")
    rollouts = draw(agent, inference, group_size=2).rollouts
    assert [r.status for r in rollouts] == ["placeholder"] * 2
    assert re.fullmatch(
        r"program: \S+test_programs\.py:\d+ in raises: RuntimeError: the program broke",
        rollouts[0].failure_reason,
    )
    assert agent.pop_metrics() == {"failures/program": 2.0, "placeholders": 2.0}


@pytest.mark.parametrize(
    ("error", "stage"),
    [
        (InferenceServerError("POST /v1/completions answered 400: too long", status=400), "inference"),
        (InferenceServerError("POST /v1/completions answered 503", status=503), "inference"),
        (UnsupportedServerError("the server ignored prompt_token_ids"), "inference"),
        (ValueError("prompt: 300 tokens leave no room"), "program"),  # the program's request, its to handle
    ],
)
def test_a_failed_inference_call_is_counted_under_inference(programs, data_file, error, stage):
    agent = make_agent(programs, data_file, "raises")
    inference = CraftedInference(agent.tokenizer, lambda i, prompt: "ok")

    async def failing(request):
        raise error

    inference.agenerate = failing
    (rollout,) = draw(agent, inference).rollouts
    assert rollout.status == "placeholder" and rollout.failure_reason.startswith(f"{stage}: ")
    assert agent.pop_metrics() == {f"failures/{stage}": 1.0, "placeholders": 1.0}


def test_a_program_past_its_call_limit_becomes_a_placeholder(programs, data_file):
    agent = make_agent(programs, data_file, "calls_forever", max_calls=3)
    inference = CraftedInference(agent.tokenizer, lambda i, prompt: "ok")
    (rollout,) = draw(agent, inference).rollouts
    assert rollout.status == "placeholder"
    assert rollout.failure_reason == "limit: more than max_calls=3 calls"
    assert len(inference.requests) == 3
    assert agent.pop_metrics() == {"failures/limit": 1.0, "placeholders": 1.0}


def test_a_program_past_its_token_limit_becomes_a_placeholder(programs, data_file):
    agent = make_agent(programs, data_file, "calls_forever", max_calls=None, max_episode_tokens=60)
    inference = CraftedInference(agent.tokenizer, lambda i, prompt: "ok")
    (rollout,) = draw(agent, inference).rollouts
    assert rollout.failure_reason.startswith("limit: ") and "max_episode_tokens=60" in rollout.failure_reason


def slowed(inference: CraftedInference, seconds: float, monkeypatch) -> None:
    original = inference.agenerate

    async def slow(request):
        await asyncio.sleep(seconds)
        return await original(request)

    monkeypatch.setattr(inference, "agenerate", slow)


def test_a_program_past_its_timeout_becomes_a_placeholder(programs, data_file, monkeypatch):
    agent = make_agent(programs, data_file, "thinks_long", timeout_s=0.2)
    inference = CraftedInference(agent.tokenizer, lambda i, prompt: "ok")
    slowed(inference, 0.05, monkeypatch)
    (rollout,) = draw(agent, inference).rollouts
    assert rollout.failure_reason == "limit: the program ran past timeout_s=0.2 s"


def test_waiting_for_generation_does_not_count_against_the_timeout(programs, data_file, monkeypatch):
    agent = make_agent(programs, data_file, "two_conversations", timeout_s=0.2)
    inference = CraftedInference(agent.tokenizer, lambda i, prompt: "ok")
    slowed(inference, 0.3, monkeypatch)  # each call waits longer than the program may run
    (rollout,) = draw(agent, inference).rollouts
    assert rollout.failure_reason is None and rollout.reward == 0.5


def test_the_client_reaches_only_its_endpoint(programs, data_file):
    agent = make_agent(programs, data_file, "raises")
    inference = CraftedInference(agent.tokenizer, lambda i, prompt: "ok")
    seen = {}

    async def program(client, problem):
        seen["models"] = [m.id for m in (await client.models.list()).data]
        try:
            await client.embeddings.create(model="m", input="x")
        except openai.NotFoundError as exc:
            seen["embeddings"] = exc.status_code
        reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return float(reply.choices[0].message.content == "ok")

    agent.program = program
    (rollout,) = draw(agent, inference).rollouts
    assert rollout.reward == 1.0 and seen == {"models": ["llmrl-policy"], "embeddings": 404}


def test_program_must_be_async_and_a_plugin(programs, data_file):
    with pytest.raises(ValueError, match="async def"):
        make_agent(programs, data_file, "not_async")
    module = types.ModuleType("not_a_plugin")
    sys.modules["not_a_plugin"] = module
    with pytest.raises(Exception, match="not a plug-in"):
        OpenAIAgent(rollout="not_a_plugin:rollout", data_files=data_file)


def test_problems_may_be_datasets_given_in_python(programs, data_file):
    import datasets

    train = datasets.Dataset.from_list([{"question": f"What is 1 + {i}?"} for i in range(5)])
    held_out = datasets.Dataset.from_list([{"question": "What is 9 + 9?"}])

    async def program(client, problem):
        return 1.0

    agent = OpenAIAgent(rollout=program, dataset=train, eval_dataset=held_out, env_id="python")
    assert [json.loads(p.prompt)["question"] for p in agent.prompts()] == train["question"]
    assert [json.loads(p.prompt)["question"] for p in agent.eval_prompts()] == ["What is 9 + 9?"]
    with pytest.raises(ValueError, match="give dataset, or path or data_files, not both"):
        OpenAIAgent(rollout=program, dataset=train, data_files=data_file)
    with pytest.raises(ValueError, match="^dataset: a DatasetDict"):
        OpenAIAgent(rollout=program, dataset=datasets.DatasetDict({"train": train}))


def test_the_program_clock_leaves_out_model_calls_made_together_once():
    from llmrl.agents.endpoint import ProgramClock

    async def episode():
        clock = ProgramClock()

        async def call(seconds):
            with clock.waiting():
                await asyncio.sleep(seconds)

        await asyncio.gather(call(0.2), call(0.3))  # overlapping: 0.3 s of waiting in all
        await asyncio.sleep(0.1)  # the program's own
        return clock.seconds()

    own = asyncio.run(episode())
    assert 0.09 <= own < 0.2
