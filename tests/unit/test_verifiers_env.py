"""verifiers environments (`agent_type: verifiers`), with the real library: the environment's own rollouts
and rubric on each episode's token-exact client.

The environments are written the way verifiers' documentation shows, in a plug-in module the tests
write; a crafted inference interface answers with chosen text over the tiny model's tokenizer
(`CraftedInference` of the openai_agent tests, with their Hermes tool template).
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import httpx
import openai
import pytest
import verifiers as vf

from llmrl.envs.verifiers_env import MISSING_EXTRA, VerifiersAgent
from llmrl.errors import UserError
from llmrl.registry import import_plugins
from llmrl.types import GenerationArgs
from tests.unit.test_openai_agent import TEMPLATE, CraftedInference

ENVIRONMENTS = '''
import verifiers as vf
from datasets import Dataset


def sums(count, start=0):
    return Dataset.from_list(
        [{"question": f"What is 2 + {i}?", "answer": str(2 + i)} for i in range(start, start + count)]
    )


def correct_answer(parser, completion, answer):
    return float(parser.parse_answer(completion) == answer)


def single_turn(with_eval=True):
    parser = vf.XMLParser(["answer"], answer_field="answer")
    functions = [correct_answer, parser.get_format_reward_func()]
    rubric = vf.Rubric(funcs=functions, weights=[1.0, 0.25], parser=parser)
    return vf.SingleTurnEnv(
        dataset=sums(8),
        eval_dataset=sums(3, start=100) if with_eval else None,
        system_prompt="Answer between <answer> and </answer>.",
        parser=parser,
        rubric=rubric,
    )


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def with_tool():
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[correct_answer], parser=parser)
    return vf.ToolEnv(dataset=sums(4), tools=[add], max_turns=3, parser=parser, rubric=rubric)


class BrokenEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise RuntimeError("the environment broke")


def broken_environment():
    return BrokenEnv(dataset=sums(4), max_turns=2, rubric=vf.Rubric(funcs=[correct_answer]))


def broken_reward(completion):
    return 1 / 0


def broken_rubric():
    return vf.SingleTurnEnv(dataset=sums(4), rubric=vf.Rubric(funcs=[correct_answer, broken_reward]))


def failing_load(size=4):
    return sums(size)["nonexistent"]


def group_rubric():
    def relative(completions, answers):
        return [0.0] * len(completions)

    return vf.SingleTurnEnv(dataset=sums(4), rubric=vf.Rubric(funcs=[relative]))
'''


@pytest.fixture(scope="module")
def environments(tmp_path_factory):
    """The plug-in module of test environments, imported as a config's `plugins:` would."""
    path = tmp_path_factory.mktemp("plugins") / "vf_test_envs.py"
    path.write_text(ENVIRONMENTS)
    import_plugins([str(path)])
    yield sys.modules["vf_test_envs"]


def make_agent(environments, function, **options) -> VerifiersAgent:
    del environments  # imported: the agent may name its functions
    return VerifiersAgent(
        environment=f"vf_test_envs:{function}",
        model_spec="tiny://arithmetic",
        chat_template=str(TEMPLATE),
        tool_parser="hermes",
        env_id="vf",
        **options,
    )


def draw(agent, inference, num_groups=1, group_size=1):
    args = GenerationArgs(max_tokens=64, seed=0)
    return asyncio.run(agent.group_rollouts(inference, num_groups, group_size, args))


class RecordingInference(CraftedInference):
    """`CraftedInference` that keeps what it answered, to compare with what was trained."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.responses = []

    async def agenerate(self, request):
        responses = await super().agenerate(request)
        self.responses.append(responses)
        return responses


def answer_text(text: str) -> str:
    """The scripted reply to the question in `text`: right and tagged, wrong and tagged, or right and bare."""
    i = int(re.findall(r"What is 2 \+ (\d+)\?", text)[-1])
    return [f"<answer>{2 + i}</answer>", f"<answer>{3 + i}</answer>", str(2 + i)][i % 3]


# ---- scoring ----------------------------------------------------------------------------------------


async def own_scoring(environment, row):
    """The environment's own rollout and scoring of `row` (verifiers alone: its client on an OpenAI client
    whose transport answers the scripted text), as `vf-eval` would score it."""

    def answer(request: httpx.Request) -> httpx.Response:
        question = request.read().decode()
        message = {"role": "assistant", "content": answer_text(question)}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
        return httpx.Response(200, json=body)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        client = openai.AsyncOpenAI(base_url="http://scripted/v1", api_key="x", http_client=http)
        output = await environment.run_rollout(row, vf.OpenAIChatCompletionsClient(client), "m", {})
    return output["reward"], output["metrics"]


def test_rewards_are_the_environments_own_scores(environments):
    agent = make_agent(environments, "single_turn")
    inference = CraftedInference(agent.tokenizer, lambda index, prompt: answer_text(prompt))
    groups = draw(agent, inference, num_groups=len(agent.train_problems))
    rows = {problem.id: problem.row for problem in agent.train_problems}
    fresh = environments.single_turn()  # not the agent's: scored by verifiers alone
    rewards = set()
    for group in groups:
        (rollout,) = group.rollouts
        assert rollout.status == "ok", rollout.failure_reason
        reward, metrics = asyncio.run(own_scoring(fresh, rows[rollout.problem_id]))
        assert rollout.reward == pytest.approx(reward)
        assert rollout.reward_components == pytest.approx(metrics)
        rewards.add(reward)
    # right and tagged, wrong and tagged, bare (the XMLParser reads no answer; part of the format reward)
    assert sorted(rewards) == pytest.approx([0.05, 0.25, 1.25])
    assert set(groups[0].rollouts[0].reward_components) == {
        "correct_answer",
        "format_reward_func",
        "num_turns",
    }


def test_problems_are_the_environments_datasets(environments):
    agent = make_agent(environments, "single_turn", eval_size=2)
    assert [p.row["question"] for p in agent.eval_problems] == [f"What is 2 + {i}?" for i in (100, 101, 102)]
    assert len(agent.train_problems) == 8
    held_out = make_agent(environments, "single_turn", environment_args={"with_eval": False}, eval_size=2)
    again = make_agent(environments, "single_turn", environment_args={"with_eval": False}, eval_size=2)
    assert len(held_out.eval_problems) == 2 and len(held_out.train_problems) == 6
    assert [p.id for p in held_out.eval_problems] == [p.id for p in again.eval_problems]


def test_an_installed_environment_is_loaded_by_its_id(environments, tmp_path, monkeypatch):
    (tmp_path / "vf_sums_env.py").write_text("from vf_test_envs import single_turn as load_environment\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    agent = VerifiersAgent(environment="vf-sums-env", environment_args={"with_eval": False}, eval_size=2)
    assert len(agent.train_problems) == 6 and agent.environment.env_id == "vf-sums-env"
    assert agent.program_definition is environments.single_turn
    sys.modules.pop("vf_sums_env")


# ---- multi-turn with a tool: token for token -------------------------------------------------------


def test_a_tool_environment_trains_on_the_sampled_tokens(environments):
    agent = make_agent(environments, "with_tool", eval_size=1)

    def script(index, prompt):
        if "<tool_response>" in prompt:
            return re.findall(r"<tool_response>\n(\d+)\n</tool_response>", prompt)[-1]
        i = re.findall(r"What is 2 \+ (\d+)\?", prompt)[-1]
        return f'<tool_call>\n{{"name": "add", "arguments": {{"a": 2, "b": {i}}}}}\n</tool_call>'

    inference = RecordingInference(agent.tokenizer, script)
    (group,) = draw(agent, inference, group_size=2)
    for rollout in group.rollouts:
        assert rollout.status == "ok", rollout.failure_reason
        assert rollout.reward == 1.0 and rollout.reward_components["num_turns"] == 2.0
        assert rollout.extra_sequences == [], "the tool turn extends the first call's sequence"
        # prompt (masked), the sampled tool call (trained), the tool's answer (masked), the answer (trained)
        assert [all(m) for m in rollout.generation_mask] == [False, True, False, True]
    first_calls = [
        r for r in inference.requests if "<tool_response>" not in agent.tokenizer.decode(r.prompt_token_ids)
    ]
    second_calls = [r for r in inference.requests if r not in first_calls]
    assert '"name": "add"' in agent.tokenizer.decode(first_calls[0].prompt_token_ids), (
        "the environment's tools="
    )
    sampled = [list(r.token_ids) for responses in inference.responses for r in responses]
    trained = [segment for r in group.rollouts for segment in r.trajectory[1::2]]
    assert sorted(trained) == sorted(sampled), "each sequence's completions are what the engine sampled"
    # the second call's prompt holds the first completion's sampled ids as they were, then the tool's turn
    assert sorted(list(r.prompt_token_ids) for r in second_calls) == sorted(
        r.trajectory[0] + r.trajectory[1] + r.trajectory[2] for r in group.rollouts
    )


# ---- failures ---------------------------------------------------------------------------------------


def test_an_environment_that_raises_fails_its_episodes_at_its_line(environments):
    agent = make_agent(environments, "broken_environment", eval_size=1)
    inference = CraftedInference(agent.tokenizer, lambda index, prompt: "7")
    rollouts = draw(agent, inference, group_size=2)[0].rollouts
    assert [r.status for r in rollouts] == ["placeholder"] * 2
    assert re.fullmatch(
        r"program: \S+vf_test_envs\.py:\d+ in BrokenEnv\.env_response: RuntimeError: the environment broke",
        rollouts[0].failure_reason,
    )
    assert agent.pop_metrics() == {"failures/program": 2.0, "placeholders": 2.0}


def test_a_reward_function_that_raises_fails_its_episodes_at_its_line(environments):
    agent = make_agent(environments, "broken_rubric", eval_size=1)
    inference = CraftedInference(agent.tokenizer, lambda index, prompt: "7")
    (rollout,) = draw(agent, inference)[0].rollouts
    assert re.fullmatch(
        r"reward: \S+vf_test_envs\.py:\d+ in broken_reward: ZeroDivisionError: division by zero",
        rollout.failure_reason,
    )
    assert agent.pop_metrics() == {"failures/reward": 1.0, "placeholders": 1.0}


def test_mistakes_are_one_line_naming_them(environments, monkeypatch):
    with pytest.raises(ValueError) as unknown:
        VerifiersAgent(environment="no-such-env", env_id="vf")
    assert str(unknown.value).startswith("environment: unknown verifiers environment 'no-such-env'")
    with pytest.raises(ValueError) as failing:
        make_agent(environments, "failing_load")
    assert re.fullmatch(
        r"environment: \S+vf_test_envs\.py:\d+ in failing_load: "
        r"ValueError: Column 'nonexistent' doesn't exist\.",
        str(failing.value),
    )
    with pytest.raises(ValueError, match="^environment: vf_test_envs:group_rubric's rubric has group reward"):
        make_agent(environments, "group_rubric")
    with pytest.raises(
        ValueError, match="^data_files: the program and the problems are the environment's own$"
    ):
        make_agent(environments, "single_turn", data_files="x.jsonl")
    for message in (unknown, failing):
        assert "\n" not in str(message.value)
    monkeypatch.setitem(sys.modules, "verifiers", None)  # not installed
    with pytest.raises(UserError) as missing:
        make_agent(environments, "single_turn")
    assert str(missing.value) == MISSING_EXTRA


def test_loading_keeps_the_processs_signal_handlers(environments):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    make_agent(environments, "single_turn")
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
