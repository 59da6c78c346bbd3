"""DAPO soft overlong punishment and overlong filtering against loops and hand-derived values."""

from __future__ import annotations

import pytest
import torch

from llmrl.algorithms.shaping import soft_overlong_penalty


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
