"""RL math as pure tensor functions: advantages, the policy loss, reward shaping, packing, logprobs.

No distributed code and no training loop here; the trainer composes these. See docs/algorithms.md
for the formulas and the papers they come from.
"""

from llmrl.algorithms.advantages import group_advantages
from llmrl.algorithms.logprobs import (
    SamplingParams,
    kept_tokens,
    logprobs_from_hidden,
    selective_log_softmax,
    token_logprobs,
)
from llmrl.algorithms.losses import LossOptions, kl_penalty, loss_normalizer, policy_loss
from llmrl.algorithms.packing import PackedBatch, build_batch, pack, pack_values, packing_efficiency, unpack
from llmrl.algorithms.shaping import soft_overlong_penalty

__all__ = [
    "LossOptions",
    "PackedBatch",
    "build_batch",
    "group_advantages",
    "kl_penalty",
    "logprobs_from_hidden",
    "loss_normalizer",
    "pack",
    "pack_values",
    "packing_efficiency",
    "policy_loss",
    "selective_log_softmax",
    "soft_overlong_penalty",
    "SamplingParams",
    "kept_tokens",
    "token_logprobs",
    "unpack",
]
