"""Reward shaping for over-long completions (DAPO, Yu et al. 2025, arXiv:2503.14476).

*Soft overlong punishment* (DAPO eq. 13). With ``L_max`` the generation budget (max_tokens) and
``L_cache`` the length of the penalty ramp (the "buffer"), a completion of ``|y|`` tokens gets the
additive reward::

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                 if |y| > L_max

scaled by ``penalty`` (our generalisation; DAPO uses 1). Completions are nudged to finish before
the budget runs out instead of being punished by a cliff.

*Overlong filtering* (DAPO section 3.4, ``algorithm.mask_truncated``) is not here: the trainer
applies it when it builds the loss masks (`llmrl.rollouts.batch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def soft_overlong_penalty(
    lengths: torch.Tensor | Sequence[int], max_tokens: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """The (non-positive) reward to add to each completion of `lengths` tokens (DAPO eq. 13).

    Args:
        lengths: completion lengths in tokens, ``[N]``.
        max_tokens: the generation budget ``L_max``.
        buffer: length of the ramp ``L_cache``; the penalty starts after ``max_tokens - buffer`` tokens.
        penalty: the penalty at ``max_tokens`` (and beyond).

    Example (max_tokens=10, buffer=4, penalty=1): lengths 6 -> 0, 7 -> -0.25, 8 -> -0.5, 10 -> -1,
    12 -> -1.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not 1 <= buffer <= max_tokens:
        raise ValueError(f"buffer (overlong_buffer) must be in 1..max_tokens={max_tokens}, got {buffer}")
    if penalty < 0:
        raise ValueError(f"penalty (overlong_penalty) must be >= 0, got {penalty}")
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
    ramp_start = max_tokens - buffer
    # clamp(-1, 0) covers all three cases: 0 before the ramp, linear on it, -1 past max_tokens.
    ramp = ((ramp_start - lengths.to(torch.float32)) / buffer).clamp(min=-1.0, max=0.0)
    return penalty * ramp
