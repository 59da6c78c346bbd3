"""Configs built in Python (`llmrl.train`): objects in place of names and files, saved as their
descriptions and compared by them for a resume; relative paths beside the config file; list items in
``--set``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import datasets
import pytest
import yaml

import llmrl
from llmrl.agents import build_agents
from llmrl.api import run_config
from llmrl.cli import main
from llmrl.config import ConfigError, config_from_dict, describe_python_object, dump_config, load_config
from llmrl.envs.arithmetic import ArithmeticAgent
from llmrl.registry import RegistryError, import_plugins, resolve_function
from llmrl.trainer.checkpoint import TRAINER_STATE, checkpoint_to_resume

QUICK = {
    "training": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "lr": 3e-4},
    "evaluation": {"at_start": False, "at_end": False, "every": 0},
    "checkpoint": {"every": 1},
    "logging": {"progress": "off", "tensorboard": False, "trace": False},
}


def sums(count: int = 80) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"prompt": f"What is {a} + {a + 7}?", "answer": str(2 * a + 7)} for a in range(10, 10 + count)]
    )


def answered(completions, answer, **kwargs):
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)]


def answered_loosely(completions, answer, **kwargs):
    return [float(a in c[0]["content"]) for c, a in zip(completions, answer, strict=True)]


def python_config(run_dir: Path, dataset: datasets.Dataset, reward) -> dict:
    return {
        "run_dir": str(run_dir),
        "environments": [
            {
                "agent_type": "dataset",
                "env_id": "sums",
                "agent_args": {"dataset": dataset, "reward_functions": [{"function": reward}]},
            }
        ],
        **QUICK,
    }


def checkpointed(config: dict) -> None:
    """A run folder whose latest checkpoint (step 1) was saved by `config`, as the trainer saves it."""
    folder = Path(config["run_dir"]) / "checkpoints" / "step_000001"
    folder.mkdir(parents=True)
    (folder / TRAINER_STATE).write_bytes(b"")
    (folder / "config.yaml").write_text(dump_config(config_from_dict(config)))


# ---- objects in a config --------------------------------------------------------------------------


def test_a_saved_config_describes_the_objects_it_was_given():
    data = sums(3)
    config = config_from_dict(
        {
            "environments": [
                {"agent_type": ArithmeticAgent, "agent_args": {"digits": 2}},
                {
                    "agent_type": "dataset",
                    "agent_args": {
                        "dataset": data,
                        "reward_functions": [answered, {"function": answered_loosely}],
                    },
                },
            ]
        }
    )
    text = dump_config(config)
    assert text.startswith("# Built in Python (llmrl.train)")
    saved = yaml.safe_load(text)["environments"]
    assert saved[0]["agent_type"] == "<python object: llmrl.envs.arithmetic:ArithmeticAgent>"
    assert config.environments[0].name == "ArithmeticAgent"
    assert saved[1]["agent_args"]["dataset"] == f"<datasets.Dataset: 3 rows, fingerprint {data._fingerprint}>"
    assert saved[1]["agent_args"]["reward_functions"] == [
        f"<python object: {__name__}:answered>",
        {"function": f"<python object: {__name__}:answered_loosely>"},
    ]
    plain = dump_config(config_from_dict({"environments": [{"agent_type": "arithmetic"}]}))
    assert not plain.startswith("#")


def test_the_same_objects_resume_and_other_ones_do_not(tmp_path):
    config = python_config(tmp_path / "run", sums(), answered)
    checkpointed(config)
    rebuilt = python_config(tmp_path / "run", sums(), answered)  # equal content: the same fingerprint
    assert checkpoint_to_resume(config_from_dict(rebuilt), force=False)[0] == 1

    other_function = python_config(tmp_path / "run", sums(), answered_loosely)
    with pytest.raises(
        ConfigError, match=r"reward_functions\[0\]\.function: '<.*:answered>' -> '<.*:answered_loosely>'"
    ):
        checkpoint_to_resume(config_from_dict(other_function), force=False)
    assert checkpoint_to_resume(config_from_dict(other_function), force=True)[0] == 1

    other_data = python_config(tmp_path / "run", sums(81), answered)
    with pytest.raises(
        ConfigError, match=r"agent_args\.dataset: '<datasets.Dataset: 80 rows.* -> '<datasets"
    ):
        checkpoint_to_resume(config_from_dict(other_data), force=False)


def test_an_agent_class_and_a_dataset_build_agents():
    data = sums(12)
    config = config_from_dict(
        {
            "environments": [
                {"agent_type": ArithmeticAgent, "agent_args": {"digits": 2, "eval_size": 4}},
                {
                    "agent_type": "dataset",
                    "env_id": "sums",
                    "agent_args": {
                        "dataset": data,
                        "eval_dataset": data.select(range(3)),
                        "reward_functions": [lambda completions, **kwargs: [1.0] * len(completions)],
                    },
                },
            ]
        }
    )
    agents = build_agents(config.environments)
    arithmetic, dataset = agents.agents
    assert isinstance(arithmetic, ArithmeticAgent) and arithmetic.env_id == "ArithmeticAgent"
    assert len(dataset.prompts()) == 12 and len(dataset.eval_prompts()) == 3


def test_a_description_read_back_from_a_saved_config_says_what_it_stands_for(tmp_path):
    config = python_config(tmp_path / "run", sums(3), answered)
    saved = yaml.safe_load(dump_config(config_from_dict(config)))
    with pytest.raises(ConfigError, match="answered> stands for an object a run was given in Python"):
        build_agents(config_from_dict(saved).environments)
    saved["environments"][0]["agent_args"]["reward_functions"] = [answered]
    with pytest.raises(ConfigError, match="expected a datasets.Dataset"):
        build_agents(config_from_dict(saved).environments)
    saved["environments"][0]["agent_type"] = "<python object: my_agents:MyAgent>"
    with pytest.raises(RegistryError, match="stands for an object a run was given in Python"):
        build_agents(config_from_dict(saved).environments)


def test_run_config_applies_overrides_to_every_form_and_keeps_the_objects(tmp_path):
    data = sums(3)
    mapping = python_config(tmp_path / "run", data, answered)
    for given in (mapping, config_from_dict(mapping)):
        config = run_config(given, ["training.steps=5", "environments[0].weight=2"])
        assert config.training.steps == 5 and config.environments[0].weight == 2
        assert config.environments[0].agent_args["dataset"] is data
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"environments": [{"agent_type": "arithmetic"}]}))
    assert run_config(path, "training.steps=3").training.steps == 3


@pytest.mark.slow
def test_train_from_python_saves_what_it_was_given_and_the_same_call_resumes(tmp_path, capsys):
    reward = lambda completions, answer, **kwargs: [  # noqa: E731 - a notebook's one-line reward
        float(c[0]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)
    ]
    config = python_config(tmp_path / "run", sums(), reward)
    summary = llmrl.train(config)
    assert summary["steps"] == 2
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["environments"][0]["agent_args"]["reward_functions"] == [
        {"function": describe_python_object(reward)}
    ]
    assert "<lambda>" in describe_python_object(reward)

    capsys.readouterr()
    assert llmrl.train(config) == summary  # the run is complete: resumed at its last step
    assert "resuming" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="resume=True"):
        llmrl.train(python_config(tmp_path / "run", sums(), answered))


# ---- relative paths -----------------------------------------------------------------------------


@pytest.fixture
def config_folder(tmp_path, monkeypatch):
    """``rf/run.yaml`` naming the plug-in ``rf_rewards`` (``rf/rf_rewards.py``) by module name and its
    data relative to ``rf/``; the working directory is elsewhere and off the import path."""
    folder = tmp_path / "rf"
    (folder / "data").mkdir(parents=True)
    (folder / "rf_rewards.py").write_text("def exact(completions, answer, **kwargs):\n    return [1.0]\n")
    (folder / "data" / "train.jsonl").write_text('{"prompt": "What is 1 + 2?", "answer": "3"}\n' * 4)
    (folder / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "plugins": ["rf_rewards"],
                "environments": [
                    {
                        "agent_type": "dataset",
                        "agent_args": {
                            "data_files": "data/train.jsonl",
                            "reward_functions": [{"function": "rf_rewards:exact"}],
                        },
                    }
                ],
            }
        )
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    yield folder
    sys.modules.pop("rf_rewards", None)


def test_paths_in_a_config_file_resolve_beside_it(config_folder):
    config = load_config(Path("..", "rf", "run.yaml"))
    assert config.plugins == [str(Path("..", "rf", "rf_rewards.py"))]
    agent_args = config.environments[0].agent_args
    assert agent_args["data_files"] == str(Path("..", "rf", "data", "train.jsonl"))
    assert config.run_dir == "runs/demo"  # the run folder stays relative to the working directory
    import_plugins(config.plugins)
    assert len(build_agents(config.environments).agents[0].prompts()) == 4


def test_a_plugin_package_beside_the_config_file_is_imported_as_a_package(config_folder):
    package = config_folder / "rf_package"
    package.mkdir()
    (package / "__init__.py").write_text("from rf_package.scores import exact\n")
    (package / "scores.py").write_text("def exact(completions, answer, **kwargs):\n    return [1.0]\n")
    config = load_config(config_folder / "run.yaml", ["plugins=[rf_package]"])
    assert config.plugins == ["rf_package"]  # --set values are relative to the working directory
    data = yaml.safe_load((config_folder / "run.yaml").read_text()) | {"plugins": ["rf_package"]}
    (config_folder / "run.yaml").write_text(yaml.safe_dump(data))
    config = load_config(config_folder / "run.yaml")
    assert config.plugins == [str(package / "__init__.py")]
    try:
        import_plugins(config.plugins)
        assert resolve_function("rf_package:exact") is resolve_function("rf_package.scores:exact")
    finally:
        sys.modules.pop("rf_package", None)
        sys.modules.pop("rf_package.scores", None)


def test_a_plugin_module_is_found_in_the_working_directory(config_folder, monkeypatch):
    monkeypatch.chdir(config_folder)
    config = load_config("run.yaml")
    assert config.plugins == ["rf_rewards"]  # beside the config is here: left as it was written
    import_plugins(config.plugins)
    assert len(build_agents(config.environments).agents[0].prompts()) == 4


def test_a_path_missing_beside_the_config_stays_relative_to_the_working_directory(config_folder):
    Path("data").mkdir()
    Path("data", "test.jsonl").write_text('{"prompt": "What is 2 + 2?", "answer": "4"}\n')
    config = load_config(
        config_folder / "run.yaml", ["environments.0.agent_args.eval_data_files=data/test.jsonl"]
    )
    assert config.environments[0].agent_args["eval_data_files"] == "data/test.jsonl"


# ---- --set with list items ----------------------------------------------------------------------


@pytest.mark.parametrize("key", ["environments.0.agent_args.digits", "environments[0].agent_args.digits"])
def test_set_reaches_a_list_item_by_number_or_in_brackets(key, capsys):
    assert main(["config", "show", "--set", f"{key}=3"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["environments"][0]["agent_args"]["digits"] == 3


def test_the_math_agent_trains_on_a_dataset_object_instead_of_its_fixture():
    import datasets

    from llmrl.envs.math import MathAgent

    rows = datasets.Dataset.from_list(
        [{"problem": "1 + 1?", "solution": "\\boxed{2}"}, {"problem": "2 + 2?", "solution": "\\boxed{4}"}]
    )
    agent = MathAgent(dataset=rows)
    assert [p.row["problem"] for p in agent.prompts()] == ["1 + 1?", "2 + 2?"]
    assert agent.eval_prompts() is None  # no fixture's evaluation split beside the user's data
