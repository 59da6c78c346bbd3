"""The synchronous pipeline: each step's groups drawn together, at most `lag` steps ahead of training."""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import Future
from typing import Any

from llmrl.errors import ServerUnavailableError, UserError
from llmrl.inference.interface import run_in_new_loop
from llmrl.rollouts.bank import BankedBatch
from llmrl.rollouts.source import AgentPipeline
from llmrl.stopping import abandonable
from llmrl.types import RolloutGroup


class RolloutPipeline(AgentPipeline):
    """Generates each step's batch at most `lag` steps ahead of training, banking every batch.

    Batch ``t`` (for training step ``t``) is generated with the weights of step ``max(0, t - 1 - lag)``:
    with ``lag=0`` right after the previous step's weights are synced (on-policy); with ``lag=L`` while
    the L steps before it train. The schedule is fixed, not a race: a batch is submitted right after
    the weights it must use are synced, and a sync waits until every batch submitted before it is
    complete, so in-flight work always finishes on the weights it started with and no sequence mixes
    two versions. With a lag, batches are drawn one at a time, in step order, by a worker thread with
    its own event loop while the trainer's thread trains; without one, on the trainer's thread. A seeded
    run therefore generates the same tokens with or without interruptions, whatever the timing.

    With `in_flight` weight updates a sync does not wait: batches generating carry on with the new
    weights (the interface records each token's version), so a batch mixes versions and which token
    gets which depends on timing.
    """

    thread_name = "llmrl-rollouts"

    def __init__(self, *args: Any, in_flight: bool = False, **kwargs: Any):
        """Takes `AgentPipeline`'s arguments, and `in_flight`: whether weight updates land while batches
        generate."""
        super().__init__(*args, **kwargs)
        self.in_flight = in_flight
        # Later batches are not drawn after a refused one.
        self._refused: ServerUnavailableError | UserError | None = None
        self._batches: dict[int, Future[list[RolloutGroup]] | None] = {}  # None: not drawn yet (lag 0)
        self._state_after: dict[int, dict[str, Any]] = {}  # agents' state right after drawing batch t
        self._next_step = 1

    def start(self, trained_step: int) -> int:
        """Continue after `trained_step`: banked batches first, then submit what the lag allows.

        Returns how many banked batches were taken up."""
        self._state_after[trained_step] = self.agents.state_dict()
        pending = self.bank.pending(trained_step)
        for banked in pending:
            done: Future[list[RolloutGroup]] = Future()
            done.set_result(banked.groups)
            self._batches[banked.step] = done
            self._state_after[banked.step] = banked.agent_state
        if pending:
            self.agents.load_state_dict(pending[-1].agent_state)
        self._next_step = trained_step + 1 + len(pending)
        self.submit_ahead(trained_step)
        return len(pending)

    def get(self, step: int) -> list[RolloutGroup]:
        """The groups of training step `step` (waits for their generation, or draws them with no lag)."""
        batch = self._batches.pop(step)
        if batch is None:
            return self._draw(step)
        with abandonable():
            return batch.result()

    def wait_ahead(self) -> None:
        """Wait until every submitted batch is complete (before the weights they use change); with
        in-flight updates, only raise a batch already refused.

        A refused batch is raised here, before the step now training can be checkpointed: its
        rerun must start from weights no newer than those the refused batch is to be generated with
        (in flight, a batch still generating may be refused after that checkpoint, and its rerun
        generates it on newer weights).
        """
        for future in list(self._batches.values()):
            if future is not None and not self.in_flight:
                future.exception()  # waits; other failures are raised by `get`
        if self._refused is not None:
            raise self._refused

    def submit_ahead(self, trained_step: int) -> None:
        """Submit the batches the weights of `trained_step` (now served) are to generate."""
        while self._next_step <= min(trained_step + 1 + self.lag, self.last_step):
            if self.lag == 0:
                # Nothing to overlap with: `get` draws it on the trainer's thread, within the step. A
                # second thread running torch ops gets its own OpenMP team, and on a small CPU the two
                # teams slow each other down.
                self._batches[self._next_step] = None
            else:
                self._batches[self._next_step] = self._worker.submit(
                    contextvars.copy_context().run, self._draw, self._next_step
                )
            self._next_step += 1

    def agent_state(self, trained_step: int) -> dict[str, Any]:
        """The agents' state as of the batch of `trained_step` (what a checkpoint of that step saves)."""
        for step in [s for s in list(self._state_after) if s < trained_step]:
            del self._state_after[step]
        return self._state_after[trained_step]

    def close(self) -> None:
        for future in self._batches.values():
            if future is not None:
                future.cancel()
        super().close()

    def _draw(self, step: int) -> list[RolloutGroup]:
        if self._refused is not None:  # drawn after a refused batch, this one would follow the wrong problems
            raise self._refused
        started = time.time()
        with abandonable():  # drawn on the trainer's thread (no lag), the step waits here for its batch
            groups = run_in_new_loop(
                self.agents.group_rollouts(
                    self.inference, self.num_groups, self.group_size, self.generation_args(step)
                )
            )
        self._refused = self.checks.refusal(step, groups, started)
        if self._refused is not None:
            raise self._refused
        state = self.agents.state_dict()
        self.bank.append(BankedBatch(step=step, groups=groups, agent_state=state))
        self._state_after[step] = state
        return groups
