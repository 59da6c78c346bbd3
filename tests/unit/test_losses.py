"""policy_loss against a loop-over-sequences-and-tokens reference, hand-derived cases, micro-batching."""

from __future__ import annotations

import math

import pytest
import torch

from llmrl.algorithms.losses import (
    LossOptions,
    TokenLoss,
    cispo_surrogate,
    dro_surrogate,
    kl_penalty,
    loss_normalizer,
    policy_loss,
)
from llmrl.config import AlgorithmConfig

AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def loss_of(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    normalizer=None,
    ref_logprobs=None,
    entropies=None,
    inference_logprobs=None,
    sequence_ids=None,
    **options,
):
    """`policy_loss` with its `LossOptions` given as keywords, as the cases below list them."""
    return policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        LossOptions(**options),
        normalizer=normalizer,
        ref_logprobs=ref_logprobs,
        entropies=entropies,
        inference_logprobs=inference_logprobs,
        sequence_ids=sequence_ids,
    )


def reference_loss(
    logprobs,
    old,
    advantages,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    ratio_level="token",
    aggregation="token_mean",
    max_length=None,
    ref_logprobs=None,
    kl_beta=0.0,
    kl_estimator="k3",
    kl_ratio_weighted=False,
    entropies=None,
    entropy_coef=0.0,
    inference_logprobs=None,
    is_mode=None,
    is_cap=2.0,
):
    """One sequence per row; every token is a separate scalar expression (autograd on `logprobs`)."""
    total = torch.zeros((), dtype=logprobs.dtype)
    num_sequences = num_tokens = 0
    for i in range(logprobs.shape[0]):
        tokens = [t for t in range(logprobs.shape[1]) if mask[i, t]]
        if not tokens:
            continue
        num_sequences += 1
        num_tokens += len(tokens)
        # GSPO: s_i = exp(mean_t log(pi / pi_old)), a function of the whole sequence.
        seq_ratio = torch.exp(sum(logprobs[i, t] - old[i, t] for t in tokens) / len(tokens))
        if is_mode == "mask":
            geometric_weight = math.exp(
                sum(float(old[i, t] - inference_logprobs[i, t]) for t in tokens) / len(tokens)
            )
            if not 1 / is_cap <= geometric_weight <= is_cap:
                continue  # the whole sequence leaves the loss, but still counts in the denominator
        sequence_total = torch.zeros((), dtype=logprobs.dtype)
        for t in tokens:
            a = float(advantages[i, t]) if advantages.dim() == 2 else float(advantages[i])
            if ratio_level == "token":
                ratio = torch.exp(logprobs[i, t] - old[i, t])
            else:  # GSPO-token: value s_i, gradient of log pi(y_t) scaled by s_i
                ratio = seq_ratio.detach() * torch.exp(logprobs[i, t] - logprobs[i, t].detach())
            clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
            token_loss = -torch.minimum(ratio * a, clipped * a)
            if dual_clip is not None and a < 0:
                token_loss = torch.minimum(token_loss, torch.tensor(-dual_clip * a, dtype=logprobs.dtype))
            if is_mode == "truncate":
                token_loss = token_loss * min(math.exp(float(old[i, t] - inference_logprobs[i, t])), is_cap)
            if kl_beta:
                log_rho = ref_logprobs[i, t] - logprobs[i, t]
                kl = {"k1": -log_rho, "k2": log_rho**2 / 2, "k3": torch.exp(log_rho) - 1 - log_rho}[
                    kl_estimator
                ]
                token_loss = token_loss + kl_beta * (ratio * kl if kl_ratio_weighted else kl)
            if entropy_coef:
                token_loss = token_loss - entropy_coef * entropies[i, t]
            sequence_total = sequence_total + token_loss
        total = total + (
            sequence_total / len(tokens) if aggregation == "seq_mean_token_mean" else sequence_total
        )
    denominator = {
        "token_mean": num_tokens,
        "seq_mean_token_mean": num_sequences,
        "seq_mean_token_sum": num_sequences,
        "seq_mean_token_sum_norm": num_sequences * (max_length or 0),
    }[aggregation]
    return total / denominator


def random_batch(seed, rows=5, width=7, per_token_advantages=False):
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    old = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 3
    logprobs = (old + 0.3 * normal(rows, width)).requires_grad_()  # ratios on both sides of the clip range
    mask = torch.rand(rows, width, generator=generator) > 0.3
    mask[:, 0] = False
    mask[1] = False  # an empty sequence: it must not count
    advantages = normal(rows, width) if per_token_advantages else normal(rows)
    return {
        "logprobs": logprobs,
        "old": old,
        "advantages": advantages,
        "mask": mask,
        "ref_logprobs": old + 0.2 * normal(rows, width),
        "entropies": torch.rand(rows, width, generator=generator, dtype=torch.float64) * 2,
        "inference_logprobs": old + 0.5 * normal(rows, width),
    }


OPTIONS = {
    "plain": {},
    "asymmetric_dual": {"clip_low": 0.1, "clip_high": 0.28, "dual_clip": 1.5},
    "kl_k1": {"kl_beta": 0.3, "kl_estimator": "k1"},
    "kl_k2": {"kl_beta": 0.3, "kl_estimator": "k2"},
    "kl_k3": {"kl_beta": 0.3, "kl_estimator": "k3"},
    "kl_ratio_weighted": {"kl_beta": 0.3, "kl_estimator": "k3", "kl_ratio_weighted": True},
    "entropy": {"entropy_coef": 0.05},
    "tis": {"is_mode": "truncate", "is_cap": 1.5},
    "mis": {"is_mode": "mask", "is_cap": 1.2},
    "everything": {
        "dual_clip": 2.0,
        "clip_high": 0.3,
        "kl_beta": 0.1,
        "entropy_coef": 0.01,
        "is_mode": "truncate",
    },
}


def run_both(batch, **options):
    """(loss, grad) from policy_loss and from the reference."""
    kwargs = dict(options)
    if kwargs.get("aggregation") == "seq_mean_token_sum_norm":
        kwargs["max_length"] = 9
    extra = {
        "ref_logprobs": batch["ref_logprobs"] if kwargs.get("kl_beta") else None,
        "entropies": batch["entropies"] if kwargs.get("entropy_coef") else None,
        "inference_logprobs": batch["inference_logprobs"] if kwargs.get("is_mode") else None,
    }
    logprobs = batch["logprobs"]
    loss, metrics = loss_of(logprobs, batch["old"], batch["advantages"], batch["mask"], **kwargs, **extra)
    (grad,) = torch.autograd.grad(loss, logprobs)
    reference_kwargs = {**kwargs, **{k: v for k, v in extra.items() if v is not None}}
    if "is_cap" not in reference_kwargs:
        reference_kwargs["is_cap"] = 2.0
    expected = reference_loss(logprobs, batch["old"], batch["advantages"], batch["mask"], **reference_kwargs)
    (expected_grad,) = torch.autograd.grad(expected, logprobs)
    return loss, grad, expected, expected_grad, metrics


@pytest.mark.parametrize("option_name", list(OPTIONS))
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_matches_reference(option_name, aggregation, ratio_level):
    for seed, per_token in [(0, False), (1, True)]:
        batch = random_batch(seed, per_token_advantages=per_token)
        loss, grad, expected, expected_grad, _ = run_both(
            batch, aggregation=aggregation, ratio_level=ratio_level, **OPTIONS[option_name]
        )
        torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
        assert (grad[~batch["mask"]] == 0).all()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gspo_equals_the_sequence_level_objective(aggregation):
    # With one advantage per sequence, the GSPO-token form has GSPO's exact gradient:
    # J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log pi/pi_old), for seq_mean_token_mean.
    # (For the other aggregations the same holds with each sequence weighted by its token count.)
    batch = random_batch(3)
    logprobs, old, advantages, mask = batch["logprobs"], batch["old"], batch["advantages"], batch["mask"]
    loss, _ = loss_of(
        logprobs, old, advantages, mask, ratio_level="sequence", aggregation=aggregation, max_length=9
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    objective, count, tokens = 0.0, 0, 0
    for i in range(logprobs.shape[0]):
        n = int(mask[i].sum())
        if n == 0:
            continue
        s = torch.exp(((logprobs[i] - old[i]) * mask[i]).sum() / n)
        term = torch.minimum(s * advantages[i], torch.clamp(s, 0.8, 1.2) * advantages[i])
        weight = {
            "seq_mean_token_mean": 1,
            "token_mean": n,
            "seq_mean_token_sum": n,
            "seq_mean_token_sum_norm": n,
        }
        objective = objective - weight[aggregation] * term
        count, tokens = count + 1, tokens + n
    denominator = {"seq_mean_token_mean": count, "token_mean": tokens, "seq_mean_token_sum": count}
    objective = objective / denominator.get(aggregation, count * 9)
    (expected_grad,) = torch.autograd.grad(objective, logprobs)
    torch.testing.assert_close(loss, objective, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)


def scalar_case(logprob, old, advantage, **options):
    lp = torch.tensor([[0.0, math.log(logprob)]], dtype=torch.float64, requires_grad=True)
    old_lp = torch.tensor([[0.0, math.log(old)]], dtype=torch.float64)
    mask = torch.tensor([[False, True]])
    loss, metrics = loss_of(lp, old_lp, torch.tensor([advantage], dtype=torch.float64), mask, **options)
    loss.backward()
    return loss.item(), lp.grad[0, 1].item(), metrics


def test_hand_derived_clipping():
    # ratio 0.6/0.5 = 1.2, A = +1, clip_high 0.1: -min(1.2, 1.1) = -1.1; clipped, so no gradient.
    loss, grad, metrics = scalar_case(0.6, 0.5, 1.0, clip_high=0.1)
    assert loss == pytest.approx(-1.1) and grad == 0.0
    assert metrics["clip_frac_high"] == 1.0 and metrics["clip_frac_low"] == 0.0
    # Same ratio, A = -1: -min(-1.2, -1.1) = 1.2 (unclipped branch); d(r)/d(log pi) = r = 1.2.
    loss, grad, metrics = scalar_case(0.6, 0.5, -1.0, clip_high=0.1)
    assert loss == pytest.approx(1.2) and grad == pytest.approx(1.2)
    assert metrics["clip_frac_high"] == 0.0
    # ratio 0.3/0.5 = 0.6, A = -1, clip_low 0.2: -min(-0.6, -0.8) = 0.8, clipped low, no gradient.
    loss, grad, metrics = scalar_case(0.3, 0.5, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0 and metrics["clip_frac_low"] == 1.0
    # Dual clip: ratio 5, A = -1: PPO gives max(5, 1.2) = 5, dual clip c = 3 caps it at 3 (no gradient).
    loss, grad, metrics = scalar_case(0.5, 0.1, -1.0, dual_clip=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0 and metrics["dual_clip_frac"] == 1.0
    # ratio 2 is below c = 3: unchanged, loss 2 with gradient 2.
    loss, grad, _ = scalar_case(0.2, 0.1, -1.0, dual_clip=3.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0)


def test_hand_derived_aggregations():
    # On-policy (ratio 1), so each token's loss is -A. Sequence 0 has 1 token with A = 1 (loss -1),
    # sequence 1 has 3 tokens with A = -2 (loss 2 each), sequence 2 is empty.
    logprobs = torch.full((3, 4), -1.0)
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -2.0, 5.0])
    expected = {
        "token_mean": (-1 + 6) / 4,  # 1.25
        "seq_mean_token_mean": (-1 + 2) / 2,  # 0.5
        "seq_mean_token_sum": (-1 + 6) / 2,  # 2.5
        "seq_mean_token_sum_norm": (-1 + 6) / (2 * 4),  # 0.625 with max_length 4
    }
    for aggregation, value in expected.items():
        loss, metrics = loss_of(logprobs, logprobs, advantages, mask, aggregation=aggregation, max_length=4)
        assert loss.item() == pytest.approx(value), aggregation
        assert metrics["num_tokens"] == 4 and metrics["num_sequences"] == 2


def test_hand_derived_kl_estimators():
    # log pi = log 0.5, log pi_ref = log 0.25: log rho = log(0.25/0.5) = -log 2.
    # k1 = log 2 = 0.6931;  k2 = (log 2)^2 / 2 = 0.2402;  k3 = 0.5 - 1 + log 2 = 0.1931.
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert float(kl_penalty(lp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(kl_penalty(lp, ref, "k2")) == pytest.approx(math.log(2) ** 2 / 2)
    assert float(kl_penalty(lp, ref, "k3")) == pytest.approx(0.5 - 1 + math.log(2))
    # In the loss (A = 0, so only the KL term): kl_beta * k3 on one token.
    zero = torch.zeros(1)
    loss, metrics = loss_of(
        lp[None], lp[None], zero, torch.ones(1, 1, dtype=torch.bool), ref_logprobs=ref[None], kl_beta=0.5
    )
    assert loss.item() == pytest.approx(0.5 * (0.5 - 1 + math.log(2)))
    assert metrics["ref_kl"] == pytest.approx(0.5 - 1 + math.log(2))
    # On-policy the ratio is 1, so weighting by it keeps the loss; its gradient adds k3 itself to
    # d k3 / d log pi = 1 - rho = 0.5.
    for weighted, slope in [(False, 0.5), (True, 0.5 + (0.5 - 1 + math.log(2)))]:
        logprob = lp[None].clone().requires_grad_()
        loss, _ = loss_of(
            logprob,
            lp[None],
            zero,
            torch.ones(1, 1, dtype=torch.bool),
            ref_logprobs=ref[None],
            kl_beta=0.5,
            kl_ratio_weighted=weighted,
        )
        (gradient,) = torch.autograd.grad(loss, logprob)
        assert loss.item() == pytest.approx(0.5 * (0.5 - 1 + math.log(2)))
        assert gradient.item() == pytest.approx(0.5 * slope)


def test_hand_derived_importance_weights():
    # Two tokens, on-policy (ratio 1), A = -1 so the per-token loss is 1.
    # old - inference = log 3 and log 0.5: raw weights 3 and 0.5; truncated at 2 -> 2 and 0.5.
    lp = torch.log(torch.tensor([[0.3, 0.2]]))
    inference = lp - torch.log(torch.tensor([[3.0, 0.5]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = loss_of(
        lp, lp, torch.tensor([-1.0]), mask, inference_logprobs=inference, is_mode="truncate"
    )
    assert loss.item() == pytest.approx((2.0 + 0.5) / 2)
    assert metrics["is_weight_mean"] == pytest.approx(1.75) and metrics["is_weight_max"] == pytest.approx(3.0)
    assert metrics["is_truncated_frac"] == 0.5
    # mismatch KL(q || pi_old) from tokens sampled by q: k3 with rho = pi_old / q = w,
    # ((3 - 1 - log 3) + (0.5 - 1 - log 0.5)) / 2 = (0.9014 + 0.1931) / 2
    assert metrics["mismatch_kl"] == pytest.approx(((3 - 1 - math.log(3)) + (0.5 - 1 - math.log(0.5))) / 2)
    # Sequence masking: geometric mean weight sqrt(3 * 0.5) = 1.22 is inside [1/1.5, 1.5] but not [1/1.2,
    # 1.2].
    loss, metrics = loss_of(
        lp, lp, torch.tensor([-1.0]), mask, inference_logprobs=inference, is_mode="mask", is_cap=1.5
    )
    assert loss.item() == pytest.approx(1.0) and metrics["is_masked_seq_frac"] == 0.0
    loss, metrics = loss_of(
        lp, lp, torch.tensor([-1.0]), mask, inference_logprobs=inference, is_mode="mask", is_cap=1.2
    )
    assert loss.item() == 0.0 and metrics["is_masked_seq_frac"] == 1.0


def test_entropy_bonus():
    # token_mean: the bonus is entropy_coef * mean H, its gradient reaches the entropies
    # (-coef / num_tokens on each masked token) and leaves the logprob gradient unchanged.
    batch = random_batch(4)
    args = (batch["logprobs"], batch["old"], batch["advantages"], batch["mask"])
    entropies = batch["entropies"].requires_grad_()
    base, _ = loss_of(*args)
    bonus, metrics = loss_of(*args, entropies=entropies, entropy_coef=0.1)
    base_grad = torch.autograd.grad(base, batch["logprobs"])[0]
    bonus_grad, entropy_grad = torch.autograd.grad(bonus, [batch["logprobs"], entropies])
    mask = batch["mask"]
    mean_entropy = entropies[mask].mean().item()
    assert (base - bonus).item() == pytest.approx(0.1 * mean_entropy)
    assert metrics["entropy"] == pytest.approx(mean_entropy)
    torch.testing.assert_close(bonus_grad, base_grad)
    torch.testing.assert_close(entropy_grad, torch.where(mask, -0.1 / mask.sum(), 0.0).double())


def test_metrics_match_loops():
    batch = random_batch(5, per_token_advantages=True)
    loss, metrics = loss_of(
        batch["logprobs"], batch["old"], batch["advantages"], batch["mask"], clip_low=0.1, clip_high=0.25
    )
    low = high = approx_kl = ratio_sum = count = 0
    logprobs = batch["logprobs"].detach()
    for i, t in batch["mask"].nonzero().tolist():
        ratio = math.exp(float(logprobs[i, t] - batch["old"][i, t]))
        a = float(batch["advantages"][i, t])
        low += a < 0 and ratio < 0.9
        high += a > 0 and ratio > 1.25
        approx_kl += (ratio - 1) - math.log(ratio)
        ratio_sum += ratio
        count += 1
    assert metrics["clip_frac_low"] == pytest.approx(low / count)
    assert metrics["clip_frac_high"] == pytest.approx(high / count)
    assert metrics["approx_kl"] == pytest.approx(approx_kl / count)
    assert metrics["ratio_mean"] == pytest.approx(ratio_sum / count)
    assert metrics["loss"] == pytest.approx(loss.item())
    assert low > 0 and high > 0  # the random batch really exercises both sides


def pack_rows(batch):
    """The same sequences as one packed row [1, tokens] with sequence ids (and per-token -1 padding)."""
    rows, width = batch["mask"].shape
    order = [3, 0, 4, 1, 2]  # shuffled, to show the ids and not the order carry the meaning
    packed = {key: torch.cat([batch[key][i] for i in order])[None] for key in batch if key != "advantages"}
    packed["sequence_ids"] = torch.cat([torch.full((width,), i) for i in order])[None]
    packed["mask"] = packed["mask"].bool()
    return packed, order


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_packed_row_equals_one_sequence_per_row(aggregation, ratio_level):
    batch = random_batch(6)
    options = {
        "aggregation": aggregation,
        "ratio_level": ratio_level,
        "max_length": 7,
        "is_mode": "mask",
        "is_cap": 1.3,
    }
    loss, _ = loss_of(
        batch["logprobs"],
        batch["old"],
        batch["advantages"],
        batch["mask"],
        inference_logprobs=batch["inference_logprobs"],
        **options,
    )
    (grad,) = torch.autograd.grad(loss, batch["logprobs"])
    packed, order = pack_rows(batch)
    packed_logprobs = packed["logprobs"].detach().requires_grad_()
    packed_loss, _ = loss_of(
        packed_logprobs,
        packed["old"],
        batch["advantages"],
        packed["mask"],
        inference_logprobs=packed["inference_logprobs"],
        sequence_ids=packed["sequence_ids"],
        **options,
    )
    (packed_grad,) = torch.autograd.grad(packed_loss, packed_logprobs)
    torch.testing.assert_close(packed_loss, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(packed_grad[0].view(len(order), -1), grad[order], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_sum_to_the_full_batch(aggregation):
    # Gradient accumulation: each micro-batch uses the full batch's normaliser; the summed
    # micro-batch gradients must equal the full-batch gradient exactly (up to float rounding).
    batch = random_batch(7, rows=9, per_token_advantages=False)
    options = {"aggregation": aggregation, "max_length": 11, "ratio_level": "sequence", "kl_beta": 0.1}
    full_loss, _ = loss_of(
        batch["logprobs"],
        batch["old"],
        batch["advantages"],
        batch["mask"],
        ref_logprobs=batch["ref_logprobs"],
        **options,
    )
    (full_grad,) = torch.autograd.grad(full_loss, batch["logprobs"])

    normalizer = loss_normalizer(batch["mask"], aggregation, max_length=11)
    splits = [slice(0, 2), slice(2, 3), slice(3, 7), slice(7, 9)]
    # The normaliser is also the sum of the micro-batches' own normalisers.
    assert normalizer == sum(loss_normalizer(batch["mask"][s], aggregation, max_length=11) for s in splits)
    total = 0.0
    for s in splits:
        micro_loss, _ = loss_of(
            batch["logprobs"][s],
            batch["old"][s],
            batch["advantages"][s],
            batch["mask"][s],
            ref_logprobs=batch["ref_logprobs"][s],
            normalizer=normalizer,
            **options,
        )
        micro_loss.backward()
        total += micro_loss.item()
    assert total == pytest.approx(full_loss.item(), rel=1e-12)
    torch.testing.assert_close(batch["logprobs"].grad, full_grad, rtol=1e-12, atol=1e-14)
    # Without the global normaliser, seq/token means of micro-batches do not add up (the test can fail).
    unnormalized = sum(
        loss_of(
            batch["logprobs"][s],
            batch["old"][s],
            batch["advantages"][s],
            batch["mask"][s],
            ref_logprobs=batch["ref_logprobs"][s],
            **options,
        )[0].item()
        for s in splits
    )
    assert unnormalized != pytest.approx(full_loss.item(), rel=1e-6)


def test_loss_normalizer_counts_packed_sequences():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 0], [0, 1, 0, 1, 1, 1, 0]], dtype=torch.bool)
    sequence_ids = torch.tensor([[0, 0, 0, 5, 5, 2, -1], [3, 3, 1, 1, 1, 1, -1]])
    # Sequences with tokens in the mask: 0 (2 tokens), 5 (1), 3 (1), 1 (3); sequence 2 has none.
    assert loss_normalizer(mask, "token_mean", sequence_ids=sequence_ids) == 7
    assert loss_normalizer(mask, "seq_mean_token_mean", sequence_ids=sequence_ids) == 4
    assert loss_normalizer(mask, "seq_mean_token_sum_norm", max_length=10, sequence_ids=sequence_ids) == 40


def test_garbage_outside_the_mask_is_ignored():
    batch = random_batch(8)
    mask = batch["mask"]
    args = {
        "ref_logprobs": batch["ref_logprobs"],
        "kl_beta": 0.2,
        "entropies": batch["entropies"],
        "entropy_coef": 0.1,
    }
    clean, _ = loss_of(batch["logprobs"], batch["old"], batch["advantages"], mask, **args)
    (clean_grad,) = torch.autograd.grad(clean, batch["logprobs"])
    dirty_logprobs = torch.where(mask, batch["logprobs"].detach(), -torch.inf).requires_grad_()
    dirty = {
        key: torch.where(mask, value, torch.nan) for key, value in args.items() if torch.is_tensor(value)
    }
    loss, _ = loss_of(
        dirty_logprobs, torch.where(mask, batch["old"], 50.0), batch["advantages"], mask, **{**args, **dirty}
    )
    loss.backward()
    torch.testing.assert_close(loss, clean)
    torch.testing.assert_close(dirty_logprobs.grad, clean_grad)


def test_empty_mask_gives_a_differentiable_zero():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = loss_of(logprobs, logprobs.detach(), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and metrics["num_tokens"] == 0
    assert (logprobs.grad == 0).all()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"aggregation": "sum"}, "aggregation"),
        ({"aggregation": "seq_mean_token_sum_norm"}, "max_length"),
        ({"ratio_level": "group"}, "ratio_level"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"kl_beta": 0.1}, "ref_logprobs"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"entropy_coef": 0.1}, "entropies"),
        ({"is_mode": "truncate"}, "inference_logprobs"),
        ({"is_mode": "clip", "inference_logprobs": torch.zeros(2, 3)}, "is_mode"),
        ({"is_cap": 0.0}, "is_cap"),
        ({"normalizer": 0.0}, "normalizer"),
        ({"ref_logprobs": torch.zeros(3, 2)}, "ref_logprobs"),
        ({"sequence_ids": torch.full((2, 3), -1)}, "sequence_ids"),
    ],
)
def test_bad_options_are_value_errors(options, message):
    logprobs = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=message):
        loss_of(logprobs, logprobs, torch.ones(2), torch.ones(2, 3, dtype=torch.bool), **options)


def test_bad_advantage_shape():
    logprobs = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages"):
        loss_of(logprobs, logprobs, torch.ones(3), mask)
    with pytest.raises(ValueError, match="advantages"):
        loss_of(logprobs, logprobs, torch.ones(1), mask, sequence_ids=torch.tensor([[0, 0, 0], [1, 1, 1]]))


@pytest.mark.parametrize(
    ("is_mode", "generation_lag", "expected"),
    [("auto", 0, None), ("auto", 2, "truncate"), ("off", 2, None), ("mask", 0, "mask")],
)
def test_loss_options_of_a_run_config(is_mode, generation_lag, expected):
    algorithm = AlgorithmConfig(is_mode=is_mode, clip_high=0.3, kl_beta=0.1)
    options = LossOptions.from_config(algorithm, max_tokens=64, generation_lag=generation_lag)
    assert options.is_mode == expected
    assert (options.max_length, options.clip_high, options.kl_beta) == (64, 0.3, 0.1)
    assert (
        LossOptions.from_config(AlgorithmConfig(max_length=9), max_tokens=64, generation_lag=0).max_length
        == 9
    )


def per_token_reference(batch, term):
    """Sum over masked tokens of ``term(logprob, old, advantage)``, one Python float at a time but for
    the logprob, which keeps its graph."""
    logprobs, old, advantages, mask = batch["logprobs"], batch["old"], batch["advantages"], batch["mask"]
    total = logprobs.new_zeros(())
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                advantage = float(advantages[i, t] if advantages.dim() == 2 else advantages[i])
                total = total + term(logprobs[i, t], float(old[i, t]), advantage)
    return total


@pytest.mark.parametrize("per_token_advantages", [False, True])
def test_cispo_matches_a_loop_and_passes_gradient_through_clipped_tokens(per_token_advantages):
    batch = random_batch(3, per_token_advantages=per_token_advantages)
    loss = TokenLoss(batch["logprobs"], batch["mask"])
    cispo_surrogate(loss, batch["old"], batch["advantages"], clip_low=0.2, clip_high=0.28)
    value = loss.aggregate("token_mean", None, normalizer=1.0)

    def term(logprob, old, advantage):
        weight = min(max(math.exp(float(logprob) - old), 0.8), 1.28)  # a constant: stop-gradient
        return -weight * advantage * logprob

    expected = per_token_reference(batch, term)
    torch.testing.assert_close(value, expected)
    (gradient,) = torch.autograd.grad(value, batch["logprobs"])
    (expected_gradient,) = torch.autograd.grad(expected, batch["logprobs"])
    torch.testing.assert_close(gradient, expected_gradient)
    clipped = batch["mask"] & ((batch["logprobs"] - batch["old"]).exp() > 1.28)
    assert clipped.any() and (gradient[clipped] != 0).all()  # unlike PPO, a clipped token still learns
    assert loss.metrics["clip_frac_high"] > 0


def test_dro_matches_a_loop():
    batch = random_batch(4, per_token_advantages=True)
    loss = TokenLoss(batch["logprobs"], batch["mask"])
    dro_surrogate(loss, batch["old"], batch["advantages"], beta=0.3)
    value = loss.aggregate("token_mean", None, normalizer=1.0)

    def term(logprob, old, advantage):
        return -(advantage * logprob - 0.5 * 0.3 * (logprob - old) ** 2)

    expected = per_token_reference(batch, term)
    torch.testing.assert_close(value, expected)
    (gradient,) = torch.autograd.grad(value, batch["logprobs"])
    (expected_gradient,) = torch.autograd.grad(expected, batch["logprobs"])
    torch.testing.assert_close(gradient, expected_gradient)
    with pytest.raises(ValueError, match="beta must be >= 0, got -1"):
        dro_surrogate(TokenLoss(batch["logprobs"], batch["mask"]), batch["old"], batch["advantages"], -1.0)
