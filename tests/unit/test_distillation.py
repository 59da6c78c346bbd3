"""On-policy distillation: the per-token advantage, its use by the update, the teacher's tokenizer check."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoTokenizer

from llmrl.algorithms.distillation import distillation_advantages, reverse_kl_sums
from llmrl.config import AlgorithmConfig, ConfigError, DistillationConfig, TrainingConfig, load_config
from llmrl.trainer import optimization
from llmrl.trainer.optimization import PolicyUpdate
from llmrl.trainer.policy import load_policy, tokenizer_mismatch
from llmrl.trainer.rollouts import prepare_batch
from llmrl.types import GenerationArgs
from tests.unit.test_trainer_parts import assert_same_weights, random_groups, tiny_policy


def test_advantages_match_a_token_by_token_loop():
    generator = torch.Generator().manual_seed(0)
    teacher = -torch.rand(3, 7, generator=generator) * 5
    policy = -torch.rand(3, 7, generator=generator) * 5
    mask = torch.rand(3, 7, generator=generator) < 0.6
    teacher[~mask] = -torch.inf  # whatever lies off the mask stays out
    advantages = distillation_advantages(teacher, policy, mask, coef=0.5)
    for row in range(3):
        for t in range(7):
            expected = 0.5 * (teacher[row, t] - policy[row, t]) if mask[row, t] else 0.0
            assert float(advantages[row, t]) == pytest.approx(float(expected), abs=1e-6)
    total, count = reverse_kl_sums(teacher, policy, mask)
    assert count == mask.sum() and total == pytest.approx(float((policy - teacher)[mask].sum()), rel=1e-6)


def test_advantages_need_one_shape():
    with pytest.raises(ValueError, match="must have one shape"):
        distillation_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))


def distill_update(groups, teacher, distillation, *, capture=None, monkeypatch=None):
    """One `PolicyUpdate` step of a fresh `tiny_policy(0)` with `teacher`; returns the policy and metrics."""
    if capture is not None:

        def recording_loss(logprobs, old_logprobs, advantages, mask, *args, **kwargs):
            capture.append((advantages.clone(), mask.clone(), kwargs["sequence_ids"].clone()))
            return real_loss(logprobs, old_logprobs, advantages, mask, *args, **kwargs)

        real_loss = optimization.policy_loss
        monkeypatch.setattr(optimization, "policy_loss", recording_loss)
    policy = tiny_policy(0)
    update = PolicyUpdate(
        policy,
        torch.optim.SGD(policy.parameters(), lr=0.5),
        algorithm=AlgorithmConfig(),
        training=TrainingConfig(lr=0.5),
        generation_args=GenerationArgs(),
        max_tokens=8,
        pad_token_id=0,
        teacher=teacher,
        distillation=distillation,
    )
    batch, _ = prepare_batch(groups, group_size=4, algorithm=AlgorithmConfig(), max_tokens=8)
    return policy, update(batch, torch.Generator().manual_seed(0)), batch


def sequence_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Each token's logprob after the ones before it (0 for the first), one sequence at a time."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.cat([torch.zeros(1), torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]])


def test_each_token_trains_on_its_reward_advantage_plus_coef_times_teacher_minus_policy(monkeypatch):
    groups = random_groups(2, 4)
    teacher, captured = tiny_policy(1).eval(), []
    _, metrics, batch = distill_update(
        groups, teacher, DistillationConfig(teacher="t", coef=0.3), capture=captured, monkeypatch=monkeypatch
    )
    student = tiny_policy(0)
    expected_kl, tokens = 0.0, 0
    for i, rollout in enumerate(batch.rollouts):
        mask = torch.tensor(rollout.mask)
        gap = sequence_logprobs(teacher, rollout.tokens) - sequence_logprobs(student, rollout.tokens)
        expected = batch.advantages[i] + 0.3 * gap[mask]
        got = torch.cat(
            [advantages[(ids == i) & token_mask.bool()] for advantages, token_mask, ids in captured]
        )
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        expected_kl -= float(gap[mask].sum())
        tokens += int(mask.sum())
    assert metrics["distill/reverse_kl"] == pytest.approx(expected_kl / tokens, rel=1e-5)
    assert metrics["distill/env/reverse_kl"] == metrics["distill/reverse_kl"]


def test_a_teacher_equal_to_the_policy_gives_no_signal_and_no_update():
    groups = random_groups(2, 4)
    teacher = copy.deepcopy(tiny_policy(0)).eval()
    policy, metrics, _ = distill_update(groups, teacher, DistillationConfig(teacher="t", rewards="ignore"))
    assert metrics["distill/reverse_kl"] == 0.0 and metrics["loss"] == 0.0
    assert_same_weights(policy, tiny_policy(0), atol=0)


def test_a_teacher_needs_its_settings():
    with pytest.raises(ValueError, match="needs its settings"):
        PolicyUpdate(
            tiny_policy(0),
            torch.optim.SGD(tiny_policy(0).parameters(), lr=0.1),
            algorithm=AlgorithmConfig(),
            training=TrainingConfig(),
            generation_args=GenerationArgs(),
            max_tokens=8,
            pad_token_id=0,
            teacher=tiny_policy(1),
        )


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.vocab)

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_tokenizer_mismatch_names_the_size_or_the_first_differing_token():
    policy = FakeTokenizer({"a": 0, "b": 1, "c": 2})
    assert tokenizer_mismatch(policy, FakeTokenizer(dict(policy.vocab))) is None
    assert tokenizer_mismatch(policy, FakeTokenizer({"a": 0, "b": 1})) == (
        "vocab size 2 in the teacher, 3 in the policy"
    )
    assert tokenizer_mismatch(policy, FakeTokenizer({"a": 0, "x": 1, "c": 2})) == (
        "token 1 is 'x' in the teacher, 'b' in the policy"
    )


def test_a_teacher_with_another_tokenizer_fails_in_one_line(tmp_path, tiny_model, tiny_model_path):
    model, _ = tiny_model
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.add_tokens(["<teacher-only>"])
    teacher_folder = tmp_path / "teacher"
    model.save_pretrained(teacher_folder)
    tokenizer.save_pretrained(teacher_folder)
    config = load_config(None, [f"run_dir={tmp_path / 'run'}", f"distillation.teacher={teacher_folder}"])
    with pytest.raises(ConfigError) as failure:
        load_policy(config, "cpu", None, None)
    message = str(failure.value)
    assert "\n" not in message
    assert str(teacher_folder) in message and "tiny://arithmetic" in message
    assert f"vocab size {len(tokenizer)} in the teacher, {len(tokenizer) - 1} in the policy" in message


def test_a_run_folder_without_checkpoints_is_no_teacher(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    config = load_config(None, [f"run_dir={tmp_path / 'run'}", f"distillation.teacher={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^distillation.teacher: .*has no checkpoint yet"):
        load_policy(config, "cpu", None, None)
