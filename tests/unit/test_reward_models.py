"""Reward models as reward function entries (``{model: FOLDER}``): scores equal the model's own forward on
TRL's texts, loaded once per process, counted in the memory plan, and a run trains with one."""

from __future__ import annotations

import asyncio
import math

import datasets
import pytest
import torch
from scripted_inference import ScriptedInference
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

import llmrl
from llmrl.agents.dataset import DatasetAgent
from llmrl.config import config_from_dict
from llmrl.models.reward_model import load_reward_model, reward_models_bytes
from llmrl.telemetry import read_metrics
from llmrl.trainer.policy import plan_training_memory


def save_classifier(tiny_model_path, folder, num_labels=1):
    """A random sequence classifier of the tiny model's shape, with its tokenizer."""
    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=num_labels)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def reward_model_folder(tmp_path_factory):
    from llmrl.models import tiny_model_path

    return save_classifier(tiny_model_path("arithmetic"), tmp_path_factory.mktemp("reward_model"))


def sums(count: int = 40) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"prompt": f"What is {a} + {a + 7}?", "answer": str(2 * a + 7)} for a in range(10, 10 + count)]
    )


def reply(prompt: str, index: int) -> str:
    return ["57", "fifty-seven", "57 or so", "I do not know"][index % 4]


def forward(folder: str, texts: list[str]) -> list[float]:
    """The reference: the saved model's forward on `texts`, padded on the right as one batch."""
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.config.pad_token_id = tokenizer.pad_token_id
    inputs = tokenizer(
        texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
    )
    with torch.no_grad():
        return model(**inputs).logits[:, 0].tolist()


@pytest.mark.parametrize("chat", [True, False])
def test_scores_equal_a_direct_forward_on_trls_texts(reward_model_folder, chat):
    agent = DatasetAgent(
        dataset=sums(),
        chat=chat,
        reward_functions=[{"model": reward_model_folder, "weight": 2.0, "device": "cpu"}],
        eval_size=2,
        env_id="sums",
    )
    (group,) = asyncio.run(agent.group_rollouts(ScriptedInference(reply), 1, 4))
    problem = next(p for p in agent.train_problems if p.id == group.rollouts[0].problem_id)
    tokenizer = AutoTokenizer.from_pretrained(reward_model_folder)
    if chat:  # the chat prompt with the reply as the assistant's, in the model's chat template
        messages = [m.model_dump() for m in problem.prompt]
        texts = [
            tokenizer.apply_chat_template(
                messages + [{"role": "assistant", "content": reply("", i)}], tokenize=False
            )
            for i in range(4)
        ]
    else:  # text prompts are concatenated with the reply, as TRL does
        texts = [problem.prompt + reply("", i) for i in range(4)]
    expected = forward(reward_model_folder, texts)
    name = reward_model_folder.rstrip("/").rsplit("/", 1)[-1]
    assert [r.reward_components for r in group.rollouts] == [{name: score} for score in expected]
    assert [r.reward for r in group.rollouts] == [2.0 * score for score in expected]
    assert len(set(expected)) == 4  # the texts differ, and so do their scores


def test_a_model_loads_once_per_process_and_environments_share_it(reward_model_folder):
    entry = {"model": reward_model_folder, "device": "cpu", "name": "rm"}
    first, second = (DatasetAgent(dataset=sums(), reward_functions=[entry], eval_size=2) for _ in range(2))
    assert first.reward_functions[0].function is second.reward_functions[0].function
    assert load_reward_model(reward_model_folder, device="cpu") is first.reward_functions[0].function


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"model": "{folder}", "device": "tpu"},
            r"r\[0\]\.device: expected one of \['auto', 'cpu', 'cuda'\]",
        ),
        ({"model": "{folder}", "dtype": "int8"}, r"r\[0\]\.dtype: expected one of \['float32'"),
        ({"model": "{folder}", "style": "trl"}, r"r\[0\]: unknown keys \['style'\]; valid keys for a model"),
        ({"model": "./nowhere"}, r"r\[0\]\.model: model spec './nowhere'"),
        ({"model": "{two_labels}"}, r"r\[0\]\.model: .* has 2 labels; a reward model has one"),
    ],
)
def test_bad_model_entries_name_the_entry(reward_model_folder, tmp_path, entry, message):
    from llmrl.models import tiny_model_path
    from llmrl.models.reward_model import reward_model_function

    two_labels = save_classifier(tiny_model_path("arithmetic"), tmp_path / "two", num_labels=2)
    entry = {k: v.format(folder=reward_model_folder, two_labels=two_labels) for k, v in entry.items()}
    with pytest.raises(ValueError, match=message):
        reward_model_function(entry, "r[0]")


def test_the_memory_plan_counts_reward_models_once_on_rank_zero(reward_model_folder):
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_folder)
    weights = sum(p.numel() for p in model.parameters()) * 4
    entries = [
        {"model": reward_model_folder, "device": "cpu"},
        {"model": reward_model_folder, "device": "cpu", "name": "again"},  # the same model: once
        {"model": reward_model_folder, "device": "cuda"},  # not on the trainer's device
    ]
    assert reward_models_bytes(entries, "cpu") == weights
    bfloat16 = {"model": reward_model_folder, "device": "cpu", "dtype": "bfloat16"}  # another copy
    assert reward_models_bytes([*entries, bfloat16], "cpu") == weights + weights // 2
    config = config_from_dict(
        {
            "environments": [
                {
                    "agent_type": "dataset",
                    "agent_args": {"data_files": "unused.jsonl", "reward_functions": entries},
                }
            ]
        }
    )
    plan = plan_training_memory(config, "cpu", None)
    assert plan.terms(rank0=True)["reward models"] == weights
    assert "reward models" not in plan.terms(rank0=False)
    assert "reward models" in plan.render()


def test_a_run_trains_with_a_reward_model(reward_model_folder, tmp_path):
    summary = llmrl.train(
        {
            "run_dir": str(tmp_path / "run"),
            "environments": [
                {
                    "agent_type": "dataset",
                    "env_id": "sums",
                    "agent_args": {
                        "dataset": sums(),
                        "eval_size": 8,
                        "reward_functions": [
                            {"model": reward_model_folder, "name": "rm", "device": "cpu"},
                            {
                                "function": lambda completions, **kwargs: [0.1] * len(completions),
                                "name": "flat",
                            },
                        ],
                    },
                }
            ],
            "training": {"steps": 2, "prompts_per_step": 2, "group_size": 4, "lr": 3e-4},
            "evaluation": {"at_start": False, "at_end": False, "every": 0},
            "checkpoint": {"every": 0},
            "logging": {"progress": "off", "tensorboard": False, "trace": False},
        }
    )
    metrics = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/sums/rm" in m]
    assert len(metrics) == 2 and all(m["reward/sums/flat"] == pytest.approx(0.1) for m in metrics)
    assert all(math.isfinite(m["train/loss"]) for m in metrics)
    assert summary["steps"] == 2
