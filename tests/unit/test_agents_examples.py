"""Every shipped example config loads, and its environments build and have problems to train and evaluate
on."""

import sys
from pathlib import Path

import pytest

from llmrl import registry
from llmrl.agents import build_agents
from llmrl.agents import dataset as dataset_module
from llmrl.config import load_config
from llmrl.types import InferenceResponse

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

_DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is {a} + {a}?\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
HUB_ROWS = {
    # Stand-ins for the hub datasets the real-size examples name, with the columns (and nesting) the
    # hub's files have: openai/gsm8k (config main), DAPO-Math-17k in verl's layout, and the AIME 2024
    # set Megatron-RL evaluates on. A new hub dataset in an example needs its stand-in here.
    "openai/gsm8k": lambda: [
        {
            "question": f"Ann has {a} apples and buys {a} more. How many now?",
            "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}",
        }
        for a in range(80)
    ],
    "BytedTsinghua-SIA/DAPO-Math-17k": lambda: [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": _DAPO_PROMPT.format(a=a)}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(2 * a), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"00000000-0000-0000-0000-{a:012d}"},
        }
        for a in range(1100)
    ],
    "Maxwell-Jia/AIME_2024": lambda: [
        {"ID": f"2024-I-{i}", "Problem": f"Find {i} + {i}.", "Solution": "Add.", "Answer": 2 * i}
        for i in range(1, 31)
    ],
}


def _hub_stand_ins(monkeypatch):
    """`load_rows` answers hub dataset names from HUB_ROWS (no network in tests); files load as usual."""
    real = dataset_module.load_rows

    def load_rows(*, path=None, data_files=None, name=None, split="train"):
        if path is None:
            return real(data_files=data_files, name=name, split=split)
        assert path in HUB_ROWS, f"no stand-in rows for the hub dataset {path!r}: add them to HUB_ROWS"
        return HUB_ROWS[path]()

    monkeypatch.setattr(dataset_module, "load_rows", load_rows)


def test_there_is_an_example_per_environment_and_a_mix():
    names = {path.stem for path in EXAMPLES}
    assert {"arithmetic", "countdown", "gsm8k", "math", "code", "dataset", "mixed"} <= names


@pytest.fixture
def plugin_state(monkeypatch):
    """Plug-ins an example imports are forgotten afterwards."""
    monkeypatch.setattr(registry, "_plugin_modules", set())
    modules = set(sys.modules)
    yield
    for name in set(sys.modules) - modules:
        if name in ("my_rewards",):
            del sys.modules[name]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_builds(path, monkeypatch, plugin_state):
    monkeypatch.chdir(ROOT)  # data and plug-in paths in the examples are relative to the repository root
    _hub_stand_ins(monkeypatch)
    config = load_config(path)
    registry.import_plugins(config.plugins)
    multi = build_agents(
        config.environments,
        config.seed,
        dynamic_sampling=config.algorithm.dynamic_sampling,
        max_resample_rounds=config.algorithm.max_resample_rounds,
    )
    counts = multi.allocation(config.training.prompts_per_step)
    assert sum(counts) == config.training.prompts_per_step
    for agent, count in zip(multi.agents, counts, strict=True):
        assert agent.eval_problems, agent.env_id
        assert count == 0 or agent.train_problems


def test_the_trl_example_scores_with_its_plain_reward_functions(monkeypatch, plugin_state):
    monkeypatch.chdir(ROOT)
    config = load_config(ROOT / "examples" / "trl_reward_functions.yaml")
    registry.import_plugins(config.plugins)
    (agent,) = build_agents(config.environments, config.seed).agents
    problem = agent.eval_problems[0]
    text = f"<think>adding up</think> <answer>{problem.row['solution']}</answer>"
    response = InferenceResponse(text=text, prompt_token_ids=[1], token_ids=[2, 3], finish_reason="stop")
    reward = agent.reward(response, problem)
    assert reward.components == {"accuracy": 1.0, "format": 1.0} and reward.value == pytest.approx(1.1)


def test_the_dapo_example_scores_the_last_answer_line(monkeypatch):
    monkeypatch.chdir(ROOT)
    (agent,) = build_agents(load_config(ROOT / "examples" / "dapo_math.yaml").environments).agents
    assert agent.layout == "verl"
    problem = agent.eval_problems[0]
    for text, score in (
        (f"So it is {problem.answer}.\nAnswer: {problem.answer}", 1.0),
        ("Answer: nothing", 0.0),
    ):
        response = InferenceResponse(text=text, prompt_token_ids=[1], token_ids=[2], finish_reason="stop")
        assert agent.reward(response, problem).value == score


def test_the_32b_recipe_evaluates_on_aime_with_the_answer_line_it_trains_on(monkeypatch):
    _hub_stand_ins(monkeypatch)
    config = load_config(ROOT / "examples" / "grpo_math_qwen32b.yaml")
    dapo, aime = build_agents(config.environments, config.seed).agents
    assert dapo.layout == "verl" and len(dapo.eval_problems) == 1024 and len(aime.eval_problems) == 30
    assert config.evaluation.samples_per_prompt == 32 and 32 in config.evaluation.ks
    problem = aime.eval_problems[0]
    assert "Answer:" in problem.prompt[-1].content and problem.row["Problem"] in problem.prompt[-1].content
    for text, score in ((f"Adding.\nAnswer: {problem.answer}", 1.0), (f"\\boxed{{{problem.answer}}}", 0.0)):
        response = InferenceResponse(text=text, prompt_token_ids=[1], token_ids=[2], finish_reason="stop")
        assert aime.reward(response, problem).value == score


def test_the_mixed_example_splits_groups_by_weight(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_config(ROOT / "examples" / "mixed.yaml")
    multi = build_agents(config.environments, config.seed)
    assert multi.allocation(config.training.prompts_per_step) == [6, 2, 0]
    assert [a.env_id for a in multi.agents] == ["arithmetic", "countdown", "gsm8k_eval"]


def test_the_plugin_in_docs_agents_md_works(monkeypatch):
    import asyncio
    import re

    import yaml
    from scripted_inference import ScriptedInference

    from llmrl import registry
    from llmrl.config import config_from_dict

    monkeypatch.setattr(registry, "_agents", dict(registry._agents))
    python, config_yaml = re.findall(
        r"```(?:python|yaml)\n(.*?)```", (ROOT / "docs" / "agents.md").read_text(), re.S
    )[:2]
    exec(compile(python, "docs/agents.md", "exec"), {})
    data = yaml.safe_load(config_yaml)
    assert data.pop("plugins") == ["my_envs"]
    multi = build_agents(config_from_dict(data).environments)
    (agent,) = multi.agents
    groups = asyncio.run(multi.group_rollouts(ScriptedInference(lambda prompt, i: "It is Paris."), 2, 2))
    rewards = {g.rollouts[0].problem_id: g.rewards for g in groups}
    assert len(agent.eval_problems) == 1 and len(rewards) == 2
    assert all(r == ([1.0, 1.0] if country == "France" else [0.0, 0.0]) for country, r in rewards.items())
