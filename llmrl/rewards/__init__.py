"""Rewards as plain functions: answer conventions, verl-style scorers, TRL/verl reward functions, and
the built-in tasks' rules (arithmetic's problems too: the tiny model is built from them)."""

from llmrl.rewards.functions import Reward, RewardFunction, Sample, combine
from llmrl.rewards.scorers import (
    default_compute_score,
    gsm8k_flexible,
    gsm8k_strict,
    math_boxed,
    math_dapo,
    normalize_dapo_answer,
)

__all__ = [
    "Reward",
    "RewardFunction",
    "Sample",
    "combine",
    "default_compute_score",
    "gsm8k_flexible",
    "gsm8k_strict",
    "math_boxed",
    "math_dapo",
    "normalize_dapo_answer",
]
