"""Every shipped example config loads, and its environments build and have problems to train and evaluate on."""

import sys
from pathlib import Path

import pytest

from llmrl import registry
from llmrl.agents import build_agents
from llmrl.config import load_config
from llmrl.types import InferenceResponse

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


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
    for text, score in ((f"So it is {problem.answer}.\nAnswer: {problem.answer}", 1.0), ("Answer: nothing", 0.0)):
        response = InferenceResponse(text=text, prompt_token_ids=[1], token_ids=[2], finish_reason="stop")
        assert agent.reward(response, problem).value == score


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
    python, config_yaml = re.findall(r"```(?:python|yaml)\n(.*?)```", (ROOT / "docs" / "agents.md").read_text(), re.S)[:2]
    exec(compile(python, "docs/agents.md", "exec"), {})
    data = yaml.safe_load(config_yaml)
    assert data.pop("plugins") == ["my_envs"]
    multi = build_agents(config_from_dict(data).environments)
    (agent,) = multi.agents
    groups = asyncio.run(multi.group_rollouts(ScriptedInference(lambda prompt, i: "It is Paris."), 2, 2))
    rewards = {g.rollouts[0].problem_id: g.rewards for g in groups}
    assert len(agent.eval_problems) == 1 and len(rewards) == 2
    assert all(r == ([1.0, 1.0] if country == "France" else [0.0, 0.0]) for country, r in rewards.items())
