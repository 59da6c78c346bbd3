"""The forward passes of a step's sequences, on one process or on this rank's share of them.

The sequences are packed into micro-batches of at most `micro_batch_tokens` tokens (the rollouts of
one prompt may share it, `plan_rows`), and each pass follows each rollout's own sampling options.
Over several processes (`llmrl.trainer.distributed`) this is the one place that knows it: each rank
packs its token-balanced share, runs zero-weight passes where it has fewer micro-batches than another
rank (FSDP's collectives need the same number of passes everywhere), runs sharded models through
`ShardedCausalLM`, and shares the no-grad passes' outputs out so that every rank holds all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from llmrl.algorithms.logprobs import SamplingParams, token_logprobs
from llmrl.algorithms.packing import (
    PackedBatch,
    Unit,
    build_batch,
    has_local_attention,
    pack,
    plan_rows,
    unit_tokens,
    unpack,
)
from llmrl.algorithms.varlen import attends_by_sequence
from llmrl.config import ConfigError, TrainingConfig
from llmrl.models.routing import (
    ROUTE_DTYPE,
    RouteCounts,
    RouteReplay,
    has_moe_routers,
    routes_for,
    routes_from_wire,
)
from llmrl.models.shape import ModelShape
from llmrl.trainer.distributed import Distributed, ShardedCausalLM, split_by_tokens
from llmrl.types import GenerationArgs, RoutedExperts

Model = torch.nn.Module | ShardedCausalLM
Scorer = Callable[[Model, PackedBatch], tuple[torch.Tensor, ...]]
"""What a no-grad pass computes per token of a packed batch: ``[R, T, ...]`` tensors."""
Shared = TypeVar("Shared")


@dataclass
class PolicyTokens:
    """What the policy's forward of a micro-batch gives the loss, with its gradient: ``[R, T]`` each."""

    logprobs: torch.Tensor
    entropies: torch.Tensor
    logits_loss: torch.Tensor | None = None
    """A per-token loss computed from the same logits, by the loss term that runs the forward."""


class PolicyForward(Protocol):
    def __call__(self, packed: PackedBatch) -> PolicyTokens: ...


class ForwardPasses:
    """Packs and runs the passes of the policy and the frozen models beside it."""

    def __init__(
        self,
        policy: torch.nn.Module,
        training: TrainingConfig,
        *,
        pad_token_id: int,
        distributed: Distributed | None = None,
        compute_dtype: torch.dtype | None = None,
        logits_chunk_tokens: int | None = None,
    ):
        """`compute_dtype`: the dtype forward and backward passes run in, when it is not the dtype of
        the policy's trained parameters (the master weights'): one process runs them under autocast;
        sharded models cast on their own (FSDP2's `MixedPrecisionPolicy`, set by `Distributed.shard`).
        `logits_chunk_tokens`: tokens per LM-head chunk (`MemoryPlan.logits_chunk_tokens`; None: the
        chunks of `llmrl.algorithms.logprobs.CHUNK_ELEMENTS` logits)."""
        self.training = training
        self.logits_chunk_tokens = logits_chunk_tokens
        self.pad_token_id = pad_token_id
        self.distributed = distributed
        shape = ModelShape.of(policy)  # packing's costs: forward FLOPs per token and per attention pair
        self._token_cost, self._pair_cost = shape.token_flops, shape.pair_flops
        # A shared prefix brings its own attention mask, which would drop a sliding window.
        self._local_attention = has_local_attention(getattr(policy, "config", None))
        self._attention_by_sequence = attends_by_sequence(policy)
        self.device = next(policy.parameters()).device
        master_dtype = next(p for p in policy.parameters() if p.requires_grad).dtype
        self._autocast_dtype = (
            compute_dtype if distributed is None and compute_dtype not in (None, master_dtype) else None
        )
        self.policy = self.runnable(policy)
        self.sampling: float | SamplingParams = 1.0
        """The step's sampling options (`follow_sampling`)."""
        self.routes: list[torch.Tensor | None] | None = None
        """The step's sequences' recorded MoE routes, ``[tokens, layers, k]`` each (`follow_routes`); None:
        routers run live, unwatched."""
        self.replay_routes = training.router_replay is True
        self._route_replays: dict[int, RouteReplay | None] = {}

    def runnable(self, model: torch.nn.Module) -> Model:
        """`model` as the passes run it: sharded models through `ShardedCausalLM`."""
        return model if self.distributed is None else ShardedCausalLM(model)

    def follow_sampling(self, args: Sequence[GenerationArgs], names: Sequence[str]) -> None:
        """From now on each rollout's logprobs follow its sampling options `args` (`sampling_params`)."""
        self.sampling = sampling_params(args, names)

    def follow_routes(self, routes: Sequence[RoutedExperts | None]) -> None:
        """From now on the passes of a model with MoE layers route each sequence's tokens through its
        recorded experts (``training.router_replay: true``), or count where the live routers part from
        them (``observe``)."""
        # Decoded once here: every pass of the step (old logprobs, update, reference) reads them.
        self.routes = [None if wire is None else routes_from_wire(wire) for wire in routes]

    @contextlib.contextmanager
    def routed(self, model: Model, packed: PackedBatch) -> Iterator[None]:
        """Forwards (and backwards: a recomputed forward routes as the first did) of `packed` by `model`
        inside the block, with the step's recorded routes (`follow_routes`)."""
        if id(model) not in self._route_replays:
            module = model.model if isinstance(model, ShardedCausalLM) else model
            self._route_replays[id(model)] = (
                RouteReplay(module) if self.routes is not None and has_moe_routers(module) else None
            )
        replay = self._route_replays[id(model)]
        if self.routes is None or replay is None or not self._routes_fit(replay):
            yield  # not asked, or a model beside the policy (a teacher) that the routes do not describe
            return
        with replay.routes(
            packed_routes(self.routes, packed, replay.layers, replay.top_k), replay=self.replay_routes
        ):
            yield

    def _routes_fit(self, replay: RouteReplay) -> bool:
        """Whether the step's routes are of `replay`'s model's MoE layers and top k (a dense model, or an
        MoE of another shape beside the policy, routes live)."""
        recorded = next((routes for routes in self.routes or () if routes is not None), None)
        return recorded is None or tuple(recorded.shape[1:]) == (replay.layers, replay.top_k)

    def route_metrics(self) -> dict[str, float]:
        """How often the policy's live routers chose other experts than those recorded, since the last
        call, over every rank's tokens (a collective when routes are followed)."""
        if self.routes is None:
            return {}
        replay = self._route_replays.get(id(self.policy))
        counts = replay.pop_counts() if replay is not None else RouteCounts(0, 0, [])
        if self.distributed is not None:
            counts = RouteCounts.summed([c for c in self.distributed.all_gather_object(counts) if c.tokens])
        return counts.shares()

    def over_ranks(self, value: Shared, combine: Callable[[list[Shared]], Shared]) -> Shared:
        """The `combine` of every rank's `value`, in rank order; on one process `value` itself."""
        return value if self.distributed is None else combine(self.distributed.all_gather_object(value))

    def policy_tokens(self, packed: PackedBatch) -> PolicyTokens:
        """The policy's logprobs and entropies of `packed`."""
        logprobs, entropies = token_logprobs(
            self.policy,
            packed,
            self.token_sampling(packed),
            with_entropy=True,
            chunk_size=self.logits_chunk_tokens,
        )
        assert entropies is not None
        return PolicyTokens(logprobs, entropies)

    def layout(
        self, sequences: list[list[int]], masks: list[list[bool]], indices: Sequence[int]
    ) -> tuple[list[Unit], int]:
        """Packing units (the rollouts of one prompt may share it) and the row length, by `plan_rows`."""
        longest_row = min(self.training.pack_row_tokens, self.training.micro_batch_tokens)
        return plan_rows(
            sequences,
            masks,
            indices,
            longest_row,
            token_cost=self._token_cost,
            pair_cost=self._pair_cost,
            share=self.training.share_prefixes and not self._local_attention,
            by_sequence=self._attention_by_sequence,
        )

    def micro_batches(
        self, sequences: list[list[int]], masks: list[list[bool]], indices: Sequence[int]
    ) -> Iterator[PackedBatch | None]:
        """This rank's micro-batches of the sequences at `indices`, then None for each pass it must
        run idle to match the rank with the most (all of them on one process)."""
        units, row_limit = self.layout(sequences, masks, indices)
        if self.distributed is None:
            yield from self._packed(sequences, masks, units, row_limit)
            return
        lengths = [len(s) for s in sequences]
        shares = split_by_tokens([unit_tokens(unit, lengths) for unit in units], self.distributed.world_size)
        mine = [units[p] for p in shares[self.distributed.rank]]
        batches = list(self._packed(sequences, masks, mine, row_limit)) if mine else []
        passes = self.distributed.max_count(len(batches))  # before any pass: a collective itself
        yield from batches
        yield from [None] * (passes - len(batches))

    def idle_pass(
        self, model: Model, sequences: list[list[int]], masks: list[list[bool]], index: int, *, backward: bool
    ) -> None:
        """A forward (and backward) pass that changes nothing, for FSDP's collectives to match up."""
        packed = self._build(sequences, masks, [[index]])
        with torch.set_grad_enabled(backward), self.compute():
            logprobs, _ = token_logprobs(
                model, packed, self.token_sampling(packed), chunk_size=self.logits_chunk_tokens
            )
            if backward:
                (logprobs.sum() * 0.0).backward()

    def sequence_logprobs(
        self, model: Model, sequences: list[list[int]], masks: list[list[bool]], indices: Sequence[int]
    ) -> list[torch.Tensor | None]:
        """Per-token logprobs of the sequences at `indices` under `model` (None for the others)."""
        outputs = self.sequence_outputs(
            model,
            sequences,
            masks,
            indices,
            lambda m, packed: token_logprobs(
                m, packed, self.token_sampling(packed), chunk_size=self.logits_chunk_tokens
            )[:1],
        )
        return [None if o is None else o[0] for o in outputs]

    @torch.no_grad()
    def sequence_outputs(
        self,
        model: Model,
        sequences: list[list[int]],
        masks: list[list[bool]],
        indices: Sequence[int],
        score: Scorer,
    ) -> list[tuple[torch.Tensor, ...] | None]:
        """What `score` computes per token for each sequence at `indices`, split back per sequence
        (None for the others); every rank gets every sequence's."""
        values: list[tuple[torch.Tensor, ...] | None] = [None] * len(sequences)
        if not indices:  # nothing to train on (every rank holds the same batch, so all return here)
            return values
        for packed in self.micro_batches(sequences, masks, indices):
            if packed is None:
                self.idle_pass(model, sequences, masks, indices[0], backward=False)
                continue
            with self.compute(), self.routed(model, packed):
                outputs = [unpack(output, packed) for output in score(model, packed)]
            for i in outputs[0]:
                values[i] = tuple(output[i].cpu() for output in outputs)
        return self.over_ranks(values, merged_shares)  # every rank trains on other shares in later passes

    def compute(self) -> contextlib.AbstractContextManager:
        """Where forward passes run in the compute dtype over master weights of another (one process)."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def token_sampling(self, packed: PackedBatch) -> float | SamplingParams:
        """The step's sampling options laid out like `packed` (each token gets its sequence's)."""
        if isinstance(self.sampling, float):
            return self.sampling
        owners = packed.sequence_ids.clamp(min=0)  # padding (-1) takes sequence 0's: never scored
        return self.sampling.map(lambda values: values.to(owners.device)[owners])

    def _packed(
        self, sequences: list[list[int]], masks: list[list[bool]], units: list[Unit], row_limit: int
    ) -> Iterator[PackedBatch]:
        """Packed micro-batches of `units`: rows of at most `row_limit` tokens (or the longest unit),
        as many rows per micro-batch as fit `micro_batch_tokens`."""
        lengths = [len(s) for s in sequences]
        unit_lengths = [unit_tokens(unit, lengths) for unit in units]
        rows = pack(unit_lengths, max(row_limit, *unit_lengths))
        chosen: list[list[Unit]] = []
        width = 0
        for row in rows:  # first-fit-decreasing: the fullest rows come first
            row_tokens = sum(unit_lengths[j] for j in row)
            if chosen and max(width, row_tokens) * (len(chosen) + 1) > self.training.micro_batch_tokens:
                yield self._build(sequences, masks, chosen)
                chosen, width = [], 0
            chosen.append([units[j] for j in row])
            width = max(width, row_tokens)
        if chosen:
            yield self._build(sequences, masks, chosen)

    def _build(
        self, sequences: list[list[int]], masks: list[list[bool]], rows: list[list[Unit]]
    ) -> PackedBatch:
        return build_batch(sequences, rows, masks, self.pad_token_id).to(self.device)


def packed_routes(
    routes: Sequence[torch.Tensor | None], packed: PackedBatch, layers: int, top_k: int
) -> torch.Tensor:
    """The recorded routes of `packed`'s tokens, ``[rows * length, layers, k]`` in the order the model
    reads them; -1 (live) on padding and past what was recorded."""
    rows, length = packed.input_ids.shape
    laid_out = torch.full((rows, length, layers, top_k), -1, dtype=ROUTE_DTYPE)
    for index, pieces in packed.spans.items():
        tokens = sum(stop - start for _, start, stop in pieces)
        sequence = routes_for(routes[index], tokens, layers, top_k)
        offset = 0
        for row, start, stop in pieces:
            laid_out[row, start:stop] = sequence[offset : offset + stop - start]
            offset += stop - start
    return laid_out.reshape(rows * length, layers, top_k)


def merged_shares(shares: list[list[Shared | None]]) -> list[Shared | None]:
    """Each position's value from the share that has one (None where none has)."""
    values = list(shares[0])
    for shared in shares[1:]:
        for i, value in enumerate(shared):
            if value is not None:
                values[i] = value
    return values


def sampling_params(args: Sequence[GenerationArgs], names: Sequence[str]) -> float | SamplingParams:
    """What the trainer's logprobs of each rollout must follow: its sampling options (`llmrl.types`).

    One temperature when every rollout was sampled alike without filters (the usual case), else
    per-rollout `SamplingParams` tensors. Options the trainer cannot reproduce are refused, naming
    the first rollout (`names[i]`) that used one.
    """
    for options, name in zip(args, names, strict=True):
        if options.temperature == 0:
            raise ConfigError(
                f"{name} was decoded greedily (temperature 0): there is no distribution to train on"
            )
        refused = options.untrainable_options
        if refused:
            raise ConfigError(
                f"{name} was sampled with {refused}, which the trainer cannot reproduce in its logprobs; use these "
                "options only in environments with evaluation_only: true"
            )
    temperatures = torch.tensor([a.temperature for a in args], dtype=torch.float32)
    top_k, top_p, min_p = ([getattr(a, name) for a in args] for name in ("top_k", "top_p", "min_p"))
    if not any(a.filters for a in args) and len(set(temperatures.tolist())) <= 1:
        return args[0].temperature if args else 1.0
    return SamplingParams(
        temperature=temperatures,
        top_k=torch.tensor(top_k, dtype=torch.int64) if any(top_k) else None,
        top_p=torch.tensor(top_p, dtype=torch.float32) if any(p < 1.0 for p in top_p) else None,
        min_p=torch.tensor(min_p, dtype=torch.float32) if any(min_p) else None,
    )
