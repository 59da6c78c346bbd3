"""On-policy distillation: the top-k reverse KL and the per-token advantage, their use by the update,
the teacher's tokenizer check."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoTokenizer

from llmrl.algorithms.distillation import (
    distillation_advantages,
    reverse_kl_sums,
    teacher_top_k,
    top_k_reverse_kl,
)
from llmrl.algorithms.logprobs import token_logprobs_and_teacher_kl, token_top_k
from llmrl.algorithms.packing import build_batch, unpack
from llmrl.config import AlgorithmConfig, ConfigError, DistillationConfig, TrainingConfig, load_config
from llmrl.rollouts import prepare_batch
from llmrl.trainer.loss_terms import policy_gradient
from llmrl.trainer.optimization import PolicyUpdate
from llmrl.trainer.policy import load_policy, tokenizer_mismatch
from llmrl.types import GenerationArgs, RolloutGroup
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


def naive_grouped_kl(policy: torch.Tensor, teacher: torch.Tensor, k: int) -> torch.Tensor:
    """The reverse KL between ``[n, V]`` logprobs over the teacher's k likeliest tokens and the rest, one
    outcome at a time."""
    out = []
    for p_row, q_row in zip(policy, teacher, strict=True):
        top = sorted(range(len(q_row)), key=lambda v: -float(q_row[v]))[:k]
        rest = [v for v in range(len(q_row)) if v not in top]
        p_mass = [p_row[v].exp() for v in top] + ([sum(p_row[v].exp() for v in rest)] if rest else [])
        q_mass = [q_row[v].exp() for v in top] + ([sum(q_row[v].exp() for v in rest)] if rest else [])
        out.append(sum(p * (p.log() - q.log()) for p, q in zip(p_mass, q_mass, strict=True)))
    return torch.stack(out)


def test_top_k_reverse_kl_and_its_gradient_match_the_kl_of_the_grouped_distributions():
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 12, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    teacher = torch.log_softmax(torch.randn(4, 12, generator=generator, dtype=torch.float64) * 2, -1)
    for k in (1, 3, 12):
        grouped, ids = teacher_top_k(teacher, k)
        got = top_k_reverse_kl(torch.log_softmax(logits, -1), grouped, ids)
        expected = naive_grouped_kl(torch.log_softmax(logits, -1), teacher, k)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
        (got_grad,) = torch.autograd.grad(got.sum(), logits)
        (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-12, rtol=1e-10)
        full = (torch.log_softmax(logits, -1).exp() * (torch.log_softmax(logits, -1) - teacher)).sum(-1)
        assert bool((got <= full + 1e-12).all())  # grouping outcomes never raises a KL
        if k == 12:  # every token its own outcome: the whole reverse KL
            torch.testing.assert_close(got, full, atol=1e-12, rtol=1e-10)


def test_a_policy_equal_to_its_teacher_has_zero_top_k_kl_and_gradient():
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(1)).requires_grad_()
    log_probs = torch.log_softmax(logits, -1)
    kl = top_k_reverse_kl(log_probs, *teacher_top_k(log_probs.detach(), 4))
    (grad,) = torch.autograd.grad(kl.sum(), logits)
    assert bool((kl == 0).all()) and bool((grad == 0).all())


def test_teacher_logprobs_need_a_column_for_the_rest():
    with pytest.raises(ValueError, match="one more column than teacher_ids"):
        top_k_reverse_kl(torch.zeros(2, 8), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64))


def test_packed_teacher_top_k_and_the_policys_kl_to_it_match_one_sequence_at_a_time():
    groups = random_groups(2, 3, seed=4)
    rollouts = [r for g in groups for r in g.rollouts]
    sequences, masks = [r.tokens for r in rollouts], [r.mask for r in rollouts]
    batch = build_batch(sequences, [[0, 1, 2], [3, 4, 5]], masks, pad_token_id=0)
    student, teacher, temperature = tiny_policy(0), tiny_policy(1).eval(), 0.7
    logprobs, grouped, ids = token_top_k(teacher, batch, temperature, k=5)
    got_logprobs, _, got_kl = token_logprobs_and_teacher_kl(
        student,
        batch,
        temperature,
        grouped,
        ids,
        chunk_size=3,  # several chunks: checkpointed
    )
    got_kl.sum().backward()
    got_grad = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    expected_total = 0.0
    for i, tokens in enumerate(sequences):
        ids_i = torch.tensor([tokens])
        mask = torch.tensor(masks[i][1:])
        with torch.no_grad():
            teacher_lp = torch.log_softmax(teacher(ids_i).logits[0, :-1] / temperature, -1)[mask]
        student_lp = torch.log_softmax(student(ids_i).logits[0, :-1] / temperature, -1)[mask]
        targets = ids_i[0, 1:][mask]
        torch.testing.assert_close(
            unpack(logprobs, batch)[i][1:][mask],
            teacher_lp.gather(-1, targets[:, None])[:, 0],
            atol=1e-5,
            rtol=0,
        )
        torch.testing.assert_close(
            unpack(got_logprobs, batch)[i][1:][mask].detach(),
            student_lp.gather(-1, targets[:, None])[:, 0].detach(),
            atol=1e-5,
            rtol=0,
        )
        expected = naive_grouped_kl(student_lp, teacher_lp, 5)
        torch.testing.assert_close(
            unpack(got_kl, batch)[i][1:][mask].detach(), expected.detach(), atol=1e-5, rtol=0
        )
        expected_total = expected_total + expected.sum()
    expected_total.backward()
    for got, parameter in zip(got_grad, student.parameters(), strict=True):
        torch.testing.assert_close(got, parameter.grad, atol=1e-5, rtol=1e-4)


def distill_update(groups, teacher, distillation, *, capture=None, monkeypatch=None):
    """One `PolicyUpdate` step of a fresh `tiny_policy(0)` with `teacher`; returns the policy and metrics."""
    if capture is not None:

        def recording_surrogate(loss, old_logprobs, advantages, *args):
            capture.append((advantages.clone(), loss.in_mask.clone(), loss.sequence_ids.clone()))
            return real_surrogate(loss, old_logprobs, advantages, *args)

        real_surrogate = policy_gradient.clipped_surrogate
        monkeypatch.setattr(policy_gradient, "clipped_surrogate", recording_surrogate)
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
        groups,
        teacher,
        DistillationConfig(teacher="t", coef=0.3, signal="sampled"),
        capture=captured,
        monkeypatch=monkeypatch,
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
    policy, metrics, _ = distill_update(
        groups, teacher, DistillationConfig(teacher="t", rewards="ignore", signal="sampled")
    )
    assert metrics["distill/reverse_kl"] == 0.0 and metrics["loss"] == 0.0
    assert_same_weights(policy, tiny_policy(0), atol=0)


def test_top_k_distillation_adds_coef_times_the_teachers_kl_to_the_loss():
    groups = random_groups(2, 4)
    teacher = tiny_policy(1).eval()
    config = DistillationConfig(teacher="t", coef=0.3, top_k=6, rewards="ignore")
    _, metrics, batch = distill_update(groups, teacher, config)
    student = tiny_policy(0)
    total, tokens, sampled = 0.0, 0, 0.0
    for rollout in batch.rollouts:
        ids = torch.tensor([rollout.tokens])
        mask = torch.tensor(rollout.mask[1:])
        with torch.no_grad():
            teacher_lp = torch.log_softmax(teacher(ids).logits[0, :-1], -1)[mask]
            student_lp = torch.log_softmax(student(ids).logits[0, :-1], -1)[mask]
        total += float(naive_grouped_kl(student_lp, teacher_lp, 6).sum())
        targets = ids[0, 1:][mask][:, None]
        sampled += float((student_lp.gather(-1, targets) - teacher_lp.gather(-1, targets)).sum())
        tokens += int(mask.sum())
    # one optimizer step over the whole batch (mini_batches 1): the KL is that of the policy before it
    assert metrics["teacher_kl"] == pytest.approx(total / tokens, rel=1e-4)
    assert metrics["loss"] == pytest.approx(0.3 * total / tokens, rel=1e-4)  # no reward term
    assert metrics["distill/reverse_kl"] == pytest.approx(sampled / tokens, rel=1e-5)


def test_a_teacher_equal_to_the_policy_gives_no_top_k_update():
    teacher = copy.deepcopy(tiny_policy(0)).eval()
    config = DistillationConfig(teacher="t", rewards="ignore")
    policy, metrics, _ = distill_update(random_groups(2, 4), teacher, config)
    assert metrics["teacher_kl"] == 0.0 and metrics["distill/reverse_kl"] == 0.0
    assert_same_weights(policy, tiny_policy(0), atol=0)


def test_top_k_distillation_refuses_filtered_sampling():
    groups = random_groups(1, 4)
    filtered = [
        r.model_copy(update={"generation_args": GenerationArgs(top_p=0.9)}) for r in groups[0].rollouts
    ]
    with pytest.raises(ConfigError, match=r"^distillation.signal: env problem .* top_p.*signal: sampled$"):
        distill_update(
            [RolloutGroup(group_id="g", rollouts=filtered)], tiny_policy(1), DistillationConfig(teacher="t")
        )


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
