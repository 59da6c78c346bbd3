"""Mixture-of-experts routes: recording the experts a forward selects, and replaying recorded ones.

In RL on an MoE model the rollout engine and the trainer each compute the router's top-k, and tiny
numerical differences between them (a kernel, a batch shape, bfloat16 rounding) flip some selections;
the trainer then computes a token's logprob through other experts than the ones that sampled it.
Rollout Routing Replay (R3, arXiv 2510.11370) makes the trainer's forward use the engine's selections,
while the gating weights still come from the live router logits, so the router keeps its gradient.

A router here is transformers' top-k router module of a family that gates by a softmax over all experts
(`REPLAYABLE_ROUTERS`): ``router(hidden [tokens, hidden]) -> (logits [tokens, E], weights [tokens, k],
experts [tokens, k])``, the weights being the chosen experts' softmax probabilities, renormalised to sum
to 1 where the family does. Replaying `experts` means gathering those probabilities at the recorded
experts instead of the top k, with the same renormalisation and dtype: where the recorded experts are
the live top k, the forward is bitwise the one without replay.

Routes are laid out per token, per MoE layer, the k experts in the router's order: ``[tokens, layers,
k]`` small integers (`ROUTE_DTYPE`); -1 marks a token without a recorded route (it routes live), such
as the last sampled token, which no engine forward ever read.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

from llmrl.errors import ModelSpecError
from llmrl.types import RoutedExperts

REPLAYABLE_ROUTERS: dict[str, str | None] = {
    "MixtralTopKRouter": None,
    "Qwen2MoeTopKRouter": "norm_topk_prob",
    "Qwen3MoeTopKRouter": "norm_topk_prob",
    "OlmoeTopKRouter": "norm_topk_prob",
}
"""Router classes whose selections can be replayed, and the attribute that says whether the chosen
experts' weights are renormalised (None: always)."""

ROUTE_DTYPE = torch.int16
"""Expert indices: up to 32,767 experts, two bytes per token, layer and choice."""


def has_moe_routers(model: torch.nn.Module) -> bool:
    return bool(_routers(model))


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        module for module in model.modules() if type(module).__name__.endswith(("TopKRouter", "TopkRouter"))
    ]


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`model`'s top-k routers, one per MoE layer, in layer order; raises `ModelSpecError` when it has
    none, or one whose gating cannot be replayed."""
    routers = _routers(model)
    if not routers:
        raise ModelSpecError(
            f"{type(model).__name__} has no mixture-of-experts layers: there are no routes to replay"
        )
    unknown = sorted({type(r).__name__ for r in routers} - set(REPLAYABLE_ROUTERS))
    if unknown:
        raise ModelSpecError(
            f"router replay: {unknown[0]} gates otherwise than a softmax over all experts; routes can be "
            f"replayed for {', '.join(sorted(REPLAYABLE_ROUTERS))}"
        )
    return routers


def renormalises(router: torch.nn.Module) -> bool:
    attribute = REPLAYABLE_ROUTERS[type(router).__name__]
    return True if attribute is None else bool(getattr(router, attribute))


class RouteRecorder:
    """While active (``with recorder:``), every router call's selected experts, per layer, in call order:
    ``calls[layer]`` is a list of ``[tokens, k]`` tensors (`ROUTE_DTYPE`, on the CPU)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> RouteRecorder:
        for layer, router in enumerate(self.routers):
            self._hooks.append(router.register_forward_hook(self._recorder(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _recorder(self, layer: int):
        def record(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            self.calls[layer].append(output[2].detach().to("cpu", ROUTE_DTYPE))

        return record

    def take(self) -> torch.Tensor:
        """The calls recorded since the last `take`, as one ``[tokens, layers, k]`` tensor (every layer
        sees the same tokens in the same calls), and forget them."""
        routes = torch.stack([torch.cat(calls) for calls in self.calls], dim=1)
        self.calls = [[] for _ in self.routers]
        return routes


class RouteReplay:
    """The trainer's side: forwards run under `routes(...)` use recorded experts (``replay=True``) or
    only compare the live ones with them (``replay=False``); either way `disagreement` counts, per layer
    and over all layers, the tokens whose live top k differs from the recorded experts (as sets)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        self.layers = len(self.routers)
        self.top_k = int(self.routers[0].top_k)
        self.tokens = 0
        self.differing = torch.zeros(self.layers, dtype=torch.long)
        self.differing_any = 0

    @contextlib.contextmanager
    def routes(self, routes: torch.Tensor, *, replay: bool) -> Iterator[None]:
        """Forwards of the tokens `routes` describes (``[tokens, layers, k]``, in the order the model
        flattens its input: batch rows one after another), inside the block."""
        expected = (self.layers, self.top_k)
        if routes.dim() != 3 or tuple(routes.shape[1:]) != expected:
            raise ValueError(
                f"routes of shape {tuple(routes.shape)}; this model needs [tokens, {expected[0]}, {expected[1]}]"
            )
        counted: set[int] = set()  # a recomputed forward (activation checkpointing) is counted once
        differs = torch.zeros(routes.shape[0], dtype=torch.bool)
        hooks = [
            router.register_forward_hook(self._hook(layer, routes[:, layer], replay, counted, differs))
            for layer, router in enumerate(self.routers)
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
        if counted:
            known = int((routes[:, 0, 0] >= 0).sum())
            self.tokens += known
            self.differing_any += int(differs.sum())

    def _hook(
        self, layer: int, recorded: torch.Tensor, replay: bool, counted: set[int], differs: torch.Tensor
    ):
        def replayed(module: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
            logits, weights, live = output
            if recorded.shape[0] != live.shape[0]:
                raise ValueError(
                    f"routes for {recorded.shape[0]} tokens; the forward routes {live.shape[0]} at MoE layer {layer}"
                )
            wanted = recorded.to(live.device, torch.long)
            known = (wanted >= 0).all(dim=-1, keepdim=True)
            if layer not in counted:
                counted.add(layer)
                differ = (live.sort(dim=-1).values != wanted.sort(dim=-1).values).any(dim=-1) & known[:, 0]
                self.differing[layer] += int(differ.sum())
                differs.logical_or_(differ.cpu())
            if not replay:
                return None
            experts = torch.where(known, wanted, live)
            chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, experts)
            if renormalises(module):
                chosen = chosen / chosen.sum(dim=-1, keepdim=True)
            return logits, chosen.to(weights.dtype), experts

        return replayed

    def pop_counts(self) -> RouteCounts:
        """What was counted since the last call."""
        counts = RouteCounts(self.tokens, self.differing_any, [int(n) for n in self.differing])
        self.tokens, self.differing_any = 0, 0
        self.differing.zero_()
        return counts


@dataclasses.dataclass(frozen=True)
class RouteCounts:
    """Recorded tokens seen, those whose live top k differed in any MoE layer, and in each."""

    tokens: int
    differing_any: int
    differing: list[int]

    @staticmethod
    def summed(counts: list[RouteCounts]) -> RouteCounts:
        """Every process's counts together (`Distributed.all_gather_object`'s list)."""
        return RouteCounts(
            sum(c.tokens for c in counts),
            sum(c.differing_any for c in counts),
            [sum(layer) for layer in zip(*(c.differing for c in counts), strict=True)],
        )

    def shares(self) -> dict[str, float]:
        """The shares of the recorded tokens whose live routing differed, any layer and each (nothing when
        no recorded token was seen)."""
        if not self.tokens:
            return {}
        metrics = {"routing/differs_any_layer": self.differing_any / self.tokens}
        return metrics | {f"routing/differs_layer_{i}": n / self.tokens for i, n in enumerate(self.differing)}


def routes_to_wire(routes: torch.Tensor) -> RoutedExperts:
    """``[tokens, layers, k]`` routes as they travel with a response or a rollout."""
    data = routes.to(ROUTE_DTYPE).numpy().astype("<i2").tobytes()
    return RoutedExperts(shape=tuple(routes.shape), data=base64.b64encode(data).decode("ascii"))


def routes_from_wire(wire: RoutedExperts) -> torch.Tensor:
    array = np.frombuffer(base64.b64decode(wire.data), dtype="<i2").reshape(wire.shape)
    return torch.from_numpy(array.astype(np.int16))


def routes_for(recorded: torch.Tensor | None, tokens: int, layers: int, k: int) -> torch.Tensor:
    """The routes of a sequence of `tokens` tokens: those `recorded` (`routes_from_wire`, cut to
    `tokens`), then -1 (live)."""
    routes = torch.full((tokens, layers, k), -1, dtype=ROUTE_DTYPE)
    if recorded is not None:
        recorded = recorded[:tokens]
        if tuple(recorded.shape[1:]) != (layers, k):
            raise ValueError(
                f"recorded routes of {recorded.shape[1]} layers x top-{recorded.shape[2]}; the model has "
                f"{layers} MoE layers x top-{k}"
            )
        routes[: recorded.shape[0]] = recorded
    return routes
