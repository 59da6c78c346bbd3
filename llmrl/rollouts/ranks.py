"""Rollouts under torchrun: rank 0 alone generates, and every rank trains on what it generated.

Rank 0 holds a pipeline and broadcasts each batch it gives (`BroadcastRollouts`); every other rank
holds `ReceivedRollouts`, which takes the batch from that broadcast. `rollouts_on_every_rank` picks
the one a rank holds; in a run of one process it is the pipeline itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from llmrl.rollouts.source import AgentState, RolloutSource
from llmrl.stopping import StepAbandoned
from llmrl.types import RolloutGroup


class Ranks(Protocol):
    """The processes of a run, as far as rollouts need them (`llmrl.trainer.distributed`)."""

    @property
    def is_main(self) -> bool: ...

    @property
    def world_size(self) -> int: ...

    def broadcast_object(self, obj: Any = None) -> Any: ...


class BroadcastRollouts(RolloutSource):
    """Rank 0's source: `pipeline`'s batches, each broadcast to the other ranks as it is taken."""

    def __init__(self, pipeline: RolloutSource, ranks: Ranks):
        self.pipeline = pipeline
        self.ranks = ranks

    def start(self, trained_step: int) -> int:
        return self.pipeline.start(trained_step)

    def get(self, step: int) -> list[RolloutGroup]:
        try:
            groups = self.pipeline.get(step)
        except StepAbandoned as abandoned:
            self.ranks.broadcast_object(abandoned)  # in place of the batch: every rank abandons the step
            raise
        return self.ranks.broadcast_object(groups)

    def wait_ahead(self) -> None:
        self.pipeline.wait_ahead()

    def submit_ahead(self, trained_step: int) -> None:
        self.pipeline.submit_ahead(trained_step)

    def agent_state(self, trained_step: int) -> AgentState:
        return self.pipeline.agent_state(trained_step)

    def pop_metrics(self) -> dict[str, float]:
        return self.pipeline.pop_metrics()

    def close(self) -> None:
        self.pipeline.close()


class ReceivedRollouts(RolloutSource):
    """Another rank's source: each step's batch as rank 0 broadcasts it; nothing generates here."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    def start(self, trained_step: int) -> int:
        return 0

    def get(self, step: int) -> list[RolloutGroup]:
        received = self.ranks.broadcast_object()
        if isinstance(received, StepAbandoned):
            raise received
        return received

    def wait_ahead(self) -> None:
        pass

    def submit_ahead(self, trained_step: int) -> None:
        pass

    def agent_state(self, trained_step: int) -> AgentState:
        raise RuntimeError("the agents and their state are rank 0's")

    def close(self) -> None:
        pass


def rollouts_on_every_rank(ranks: Ranks, pipeline: Callable[[], RolloutSource]) -> RolloutSource:
    """The source this rank holds: on rank 0 `pipeline()`, broadcasting its batches when there are other
    ranks; elsewhere the receiver of that broadcast."""
    if not ranks.is_main:
        return ReceivedRollouts(ranks)
    return pipeline() if ranks.world_size == 1 else BroadcastRollouts(pipeline(), ranks)
