"""Group advantages against a loop-over-groups reference and hand-derived cases."""

from __future__ import annotations

import math

import pytest
import torch

from llmrl.algorithms.advantages import group_advantages


def naive_std(values, ddof):
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - ddof))


def reference_advantages(
    rewards, group_size, estimator, valid, batch_std_normalize=False, std_scope="group", ddof=0, eps=1e-6
):
    """Plain-Python loops over groups and rollouts; the obviously-correct version."""
    out = [0.0] * len(rewards)
    batch_std = naive_std([r for r, ok in zip(rewards, valid, strict=True) if ok], ddof)
    for start in range(0, len(rewards), group_size):
        members = [i for i in range(start, start + group_size) if valid[i]]
        values = [rewards[i] for i in members]
        if not values or max(values) == min(values):
            continue  # no signal: zeros
        mean = sum(values) / len(values)
        std = naive_std(values, ddof) if std_scope == "group" else batch_std
        for i in members:
            if estimator == "grpo":
                out[i] = (rewards[i] - mean) / (std + eps)
            elif estimator == "dr_grpo":
                out[i] = rewards[i] - mean
            else:
                others = [rewards[j] for j in members if j != i]
                out[i] = rewards[i] - sum(others) / len(others)
    if batch_std_normalize:
        std = naive_std([out[i] for i in range(len(rewards)) if valid[i]], ddof)
        out = [a / (std + eps) for a in out]
    return out


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("batch_std_normalize", [False, True])
@pytest.mark.parametrize(
    ("std_scope", "ddof", "eps"), [("group", 0, 1e-6), ("group", 1, 1e-4), ("batch", 1, 1e-4)]
)
def test_matches_reference_on_random_groups(estimator, batch_std_normalize, std_scope, ddof, eps):
    generator = torch.Generator().manual_seed(0)
    group_size, num_groups = 5, 12
    # Integer-ish rewards so that some groups are all-equal, plus a continuous part elsewhere.
    rewards = torch.randint(0, 2, (num_groups * group_size,), generator=generator).double()
    rewards[group_size * 6 :] += torch.rand(group_size * 6, generator=generator, dtype=torch.float64)
    valid = torch.rand(num_groups * group_size, generator=generator) > 0.2
    valid[:group_size] = False  # a group with no valid rollout at all
    options = {"batch_std_normalize": batch_std_normalize, "std_scope": std_scope, "ddof": ddof, "eps": eps}
    expected = reference_advantages(rewards.tolist(), group_size, estimator, valid.tolist(), **options)
    got = group_advantages(rewards, group_size, estimator, valid, **options)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert (got[~valid] == 0).all()


def test_hand_derived_group():
    # rewards [1, 0, 0, 1]: mean 0.5, population std 0.5.
    rewards = [1.0, 0.0, 0.0, 1.0]
    # grpo: (r - 0.5) / 0.5 = [1, -1, -1, 1] (eps=0 to make it exact)
    assert group_advantages(rewards, 4, "grpo", eps=0.0).tolist() == [1.0, -1.0, -1.0, 1.0]
    # dr_grpo: r - 0.5
    assert group_advantages(rewards, 4, "dr_grpo").tolist() == [0.5, -0.5, -0.5, 0.5]
    # rloo: 1 - mean(0, 0, 1) = 2/3;  0 - mean(1, 0, 1) = -2/3
    torch.testing.assert_close(group_advantages(rewards, 4, "rloo"), torch.tensor([2, -2, -2, 2]) / 3.0)
    # sample std (ddof=1): sqrt(4 * 0.25 / 3) = 1/sqrt(3), so (r - 0.5) * sqrt(3)
    root3 = math.sqrt(3)
    torch.testing.assert_close(
        group_advantages(rewards, 4, "grpo", ddof=1, eps=0.0), torch.tensor([1, -1, -1, 1]) * root3 / 2
    )


def test_batch_std_scope_keeps_group_means_and_divides_by_the_std_of_all_rewards():
    # Groups [1, 0] and [0, 0]; all four rewards have mean 1/4 and population std sqrt(3)/4.
    got = group_advantages([1.0, 0.0, 0.0, 0.0], 2, "grpo", std_scope="batch", eps=0.0)
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, 0.0, 0.0]) / (math.sqrt(3) / 4))


def test_invalid_rollouts_are_left_out_and_get_zero():
    # Valid rewards of the group are [1, 0, 0] (the 5 is a placeholder): mean 1/3,
    # dr_grpo advantages [2/3, -1/3, -1/3] and 0 for the placeholder.
    got = group_advantages([1.0, 0.0, 5.0, 0.0], 4, "dr_grpo", valid=[True, True, False, True])
    torch.testing.assert_close(got, torch.tensor([2 / 3, -1 / 3, 0.0, -1 / 3]))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_give_exact_zeros(estimator):
    # 0.1 * 3 / 3 != 0.1 in floating point; the std division must not amplify that noise.
    got = group_advantages([0.1, 0.1, 0.1, 1.0, 1.0, 1.0], 3, estimator)
    assert got.tolist() == [0.0] * 6
    lone = group_advantages([1.0, 0.0, 0.0], 3, estimator, valid=[True, False, False])
    assert lone.tolist() == [0.0, 0.0, 0.0]  # one valid rollout: no baseline, no signal
    lone_sample_std = group_advantages(
        [1.0, 0.0, 0.0], 3, estimator, valid=[True, False, False], ddof=1, eps=0.0
    )
    assert lone_sample_std.tolist() == [0.0, 0.0, 0.0]  # n - ddof = 0 must not make NaN
    assert not torch.isnan(group_advantages([2.0] * 4, 4, estimator, batch_std_normalize=True)).any()


def test_groups_are_independent():
    together = group_advantages([1.0, 0.0, 3.0, 5.0], 2, "grpo")
    separate = torch.cat([group_advantages([1.0, 0.0], 2, "grpo"), group_advantages([3.0, 5.0], 2, "grpo")])
    torch.testing.assert_close(together, separate)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rewards": [1.0, 2.0, 3.0], "group_size": 2}, "multiple of group_size"),
        ({"rewards": [1.0, 2.0], "group_size": 0}, "group_size"),
        ({"rewards": [1.0, 2.0], "group_size": 2, "estimator": "ppo"}, "estimator"),
        ({"rewards": [1.0, 2.0], "group_size": 2, "valid": [True]}, "valid"),
        ({"rewards": [[1.0, 2.0]], "group_size": 2}, "rewards"),
        ({"rewards": [1.0, 2.0], "group_size": 2, "std_scope": "global"}, "std_scope"),
        ({"rewards": [1.0, 2.0], "group_size": 2, "ddof": 2}, "ddof"),
    ],
)
def test_bad_input_is_a_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(**kwargs)
