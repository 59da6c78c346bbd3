"""The Tinker API's built-in losses, as its documentation defines them, built from llmrl's loss terms.

Every loss is a sum over the data's tokens (no mean): with ``lp`` the trained model's logprob of a
target token, ``q`` the sampler's (``loss_fn_inputs["logprobs"]``), ``A`` its advantage and
``r = exp(lp - q)``::

    cross_entropy         -sum w * lp
    importance_sampling   -sum r * A
    ppo                   -sum min(r * A, clip(r, low, high) * A)
    cispo                 -sum sg[clip(r, low, high)] * lp * A
    dro                   -sum (lp * A - beta / 2 * (lp - q)^2)

``low`` and ``high`` are ``loss_fn_config``'s ``clip_low_threshold`` and ``clip_high_threshold``
(0.8 and 1.2 unless given); DRO's ``beta`` has no default. The policy-gradient losses take an optional
``weights`` mask: tokens whose weight is 0 are left out. The surrogates are llmrl's own
(`llmrl.algorithms.losses`): ``importance_sampling`` and ``ppo`` are its clipped surrogate (with the
clip range open for the first), ``cispo`` and ``dro`` its `cispo_surrogate` and `dro_surrogate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from llmrl.algorithms.losses import LossOptions, TokenLoss, cispo_surrogate, clipped_surrogate, dro_surrogate

POLICY_GRADIENT_INPUTS = ("logprobs", "advantages")
CLIP_THRESHOLDS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


@dataclass(frozen=True)
class LossSpec:
    """What a loss takes: its required and optional ``loss_fn_inputs`` (besides ``target_tokens``) and its
    ``loss_fn_config`` keys with their defaults (None: required)."""

    inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config: dict[str, float | None] = field(default_factory=dict)


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(inputs=("weights",)),
    "importance_sampling": LossSpec(inputs=POLICY_GRADIENT_INPUTS, optional_inputs=("weights",)),
    "ppo": LossSpec(
        inputs=POLICY_GRADIENT_INPUTS, optional_inputs=("weights",), config=dict(CLIP_THRESHOLDS)
    ),
    "cispo": LossSpec(
        inputs=POLICY_GRADIENT_INPUTS, optional_inputs=("weights",), config=dict(CLIP_THRESHOLDS)
    ),
    "dro": LossSpec(inputs=POLICY_GRADIENT_INPUTS, optional_inputs=("weights",), config={"beta": None}),
}
NOT_SERVED = {
    "gspo": "not served yet",
    "stable_reinforce": "not served yet",
    "custom": "a loss uploaded with create_custom_loss is not served (forward_backward_custom with a Python "
    "function is)",
}


@dataclass(frozen=True)
class LossCall:
    """A built-in loss and its settings, checked."""

    name: str
    spec: LossSpec
    config: dict[str, float]

    @classmethod
    def of(cls, name: str, given: dict[str, float | str]) -> LossCall:
        """The loss `name` with the ``loss_fn_config`` `given`; a ValueError names what is wrong."""
        if name not in LOSSES:
            why = NOT_SERVED.get(name, "unknown")
            raise ValueError(f"loss_fn: {name!r}: {why} (served: {', '.join(LOSSES)})")
        spec = LOSSES[name]
        for key, value in given.items():
            if key not in spec.config:
                takes = ", ".join(spec.config) or "no settings"
                raise ValueError(f"loss_fn_config.{key}: {name} takes {takes}")
            if isinstance(value, str) or not math.isfinite(value):
                raise ValueError(f"loss_fn_config.{key}: must be a finite number, got {value!r}")
        config: dict[str, float] = {}
        for key, default in spec.config.items():
            value = given.get(key, default)
            if value is None:
                raise ValueError(f"loss_fn_config.{key}: required by {name}")
            config[key] = float(value)
        low, high = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 1.0)
        if not 0.0 <= low <= 1.0 <= high:
            raise ValueError(
                f"loss_fn_config: {name} needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
                f"got {low} and {high}"
            )
        if config.get("beta", 0.0) < 0:
            raise ValueError(f"loss_fn_config.beta: must be >= 0, got {config['beta']}")
        return cls(name, spec, config)


def tinker_loss(
    call: LossCall, target_logprobs: list[torch.Tensor], inputs: list[dict[str, torch.Tensor]]
) -> torch.Tensor:
    """The summed loss of `call` over the data: each datum's target logprobs (carrying the gradient)
    and its ``loss_fn_inputs`` by name (module docstring)."""
    logprobs = torch.cat(target_logprobs)[None]

    def joined(name: str) -> torch.Tensor:
        return torch.cat([datum[name] for datum in inputs]).to(logprobs)[None]

    if call.name == "cross_entropy":
        return -(joined("weights") * logprobs).sum()
    everywhere = [torch.ones(len(values)) for values in target_logprobs]
    masks = [datum.get("weights", ones) for datum, ones in zip(inputs, everywhere, strict=True)]
    mask = torch.cat(masks)[None] != 0
    loss = TokenLoss(logprobs, mask)
    sampled, advantages = joined("logprobs"), joined("advantages")
    low = 1.0 - call.config.get("clip_low_threshold", 0.0)
    high = call.config.get("clip_high_threshold", math.inf) - 1.0
    if call.name in ("importance_sampling", "ppo"):
        clipped_surrogate(loss, sampled, advantages, LossOptions(clip_low=low, clip_high=high))
    elif call.name == "cispo":
        cispo_surrogate(loss, sampled, advantages, clip_low=low, clip_high=high)
    else:
        dro_surrogate(loss, sampled, advantages, beta=call.config["beta"])
    return loss.aggregate("token_mean", None, normalizer=1.0)
