"""DAPO soft overlong punishment and overlong filtering against loops and hand-derived values."""

from __future__ import annotations

import pytest
import torch

from llmrl.algorithms.shaping import drop_truncated, soft_overlong_penalty


def reference_penalty(length, max_tokens, buffer, penalty):
    """DAPO eq. 13, case by case."""
    if length <= max_tokens - buffer:
        return 0.0
    if length <= max_tokens:
        return penalty * ((max_tokens - buffer) - length) / buffer
    return -penalty


def test_hand_derived_values():
    # max_tokens 10, buffer 4: the ramp starts after 6 tokens and loses 1/4 per token.
    got = soft_overlong_penalty([1, 6, 7, 8, 10, 12], max_tokens=10, buffer=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    # penalty scales the whole ramp.
    assert soft_overlong_penalty([8], max_tokens=10, buffer=4, penalty=0.5).tolist() == [-0.25]


def test_matches_reference_on_all_lengths():
    for max_tokens, buffer, penalty in [(16, 5, 1.0), (16, 16, 2.0), (7, 1, 0.3)]:
        lengths = list(range(1, max_tokens + 4))
        expected = [reference_penalty(n, max_tokens, buffer, penalty) for n in lengths]
        got = soft_overlong_penalty(lengths, max_tokens, buffer, penalty)
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 10, "buffer": 0}, "buffer"),
        ({"max_tokens": 10, "buffer": 11}, "buffer"),
        ({"max_tokens": 0, "buffer": 1}, "max_tokens"),
        ({"max_tokens": 10, "buffer": 2, "penalty": -1.0}, "penalty"),
    ],
)
def test_bad_penalty_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        soft_overlong_penalty([3], **kwargs)


def test_drop_truncated_rows():
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1]], dtype=torch.bool)
    got = drop_truncated(mask, [False, True, False])
    assert got.tolist() == [[False, True, True], [False, False, False], [False, True, True]]
    float_mask = mask.float()
    assert drop_truncated(float_mask, torch.tensor([True, False, False])).tolist() == [
        [0, 0, 0],
        [0, 1, 0],
        [0, 1, 1],
    ]


def test_drop_truncated_packed_matches_loop():
    generator = torch.Generator().manual_seed(0)
    sequence_ids = torch.tensor([[0, 0, 0, 2, 2, 1, 1, 1, -1], [3, 3, 4, 4, 4, 4, -1, -1, -1]])
    mask = (torch.rand(sequence_ids.shape, generator=generator) > 0.3) & (sequence_ids >= 0)
    truncated = [False, True, False, True, False]
    got = drop_truncated(mask, truncated, sequence_ids)
    for r in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            expected = bool(mask[r, t]) and not truncated[int(sequence_ids[r, t])]
            assert bool(got[r, t]) == expected


def test_drop_truncated_checks_shapes():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="truncated"):
        drop_truncated(mask, [True])
    with pytest.raises(ValueError, match="sequence_ids"):
        drop_truncated(mask, [True], torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence_ids"):
        drop_truncated(mask, [True], torch.full((2, 3), 3))
