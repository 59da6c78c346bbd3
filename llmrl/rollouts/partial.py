"""Partial rollouts: groups generated continuously, one at a time, batches made of whichever complete first.

`PartialRolloutPipeline` stands in for `llmrl.rollouts.synchronous.RolloutPipeline` when
`training.partial_rollouts` is on (with a lag). A worker thread keeps up to ``(lag + 1) *
num_groups`` groups generating, complete or in the step training now, and launches new groups as
soon as a step's new weights serve (as `RolloutPipeline` submits a batch), so that a group that
completes in time is at most `lag` versions old when trained. Group k comes from the agent of
``agents.slots(num_groups)[k % num_groups]``, so every `num_groups` consecutive groups follow the
environments' weights, and is sampled with a seed derived from k. The batch of step t is the first `num_groups` groups to complete that no earlier
batch took: a slow group is trained in a later batch, never dropped, so long answers are not
trained less often than short ones. Its rollouts may then be older than the lag: with
`max_staleness`, a complete group whose oldest token is more versions behind the policy about to
train on it than that is generated again for the same problem (`rollout/stale_regenerated`), so
the bound does not favour short answers either.

A group is generated again by replaying its launch: the agents' state from before the launch is
loaded, every group of it is started again so that each draws the problem it had (built-in agents
draw their problems before their first `await`), and all but the one wanted are cancelled at once,
before they generate; then the agents' state is put back.

The engine never runs dry between steps, so with ``inference.weight_update: in_flight`` every sync
lands in the middle of running sequences, which go on with the new weights.

Which groups a batch takes depends on timing, so such a run is not bitwise repeatable. The rollout
bank records every launch, complete group and batch (`llmrl.rollouts.bank`); a resumed run trains the
recorded batches of later steps as they were, puts complete groups no batch took back in the pool,
and generates again the groups that were still running (`rollout/regenerated_after_interruption`):
it loads the agents' state from before their launch, starts the whole launch again so that every
group draws the problem it had, and cancels at once those it does not need. A batch refused for
failures is generated again the same way by the rerun. Then drawing goes on from the agents' state
after the newest launch.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections import Counter
from typing import Any

from llmrl.agents.base import failed_in_inference, failed_unreachable
from llmrl.inference.interface import run_in_new_loop
from llmrl.rollouts.bank import Launch
from llmrl.rollouts.source import AgentPipeline, AgentState
from llmrl.stopping import abandonable
from llmrl.types import RolloutGroup

log = logging.getLogger(__name__)


class PartialRolloutPipeline(AgentPipeline):
    """Continuous generation of groups for training steps up to `last_step` (see the module docstring)."""

    thread_name = "llmrl-partial-rollouts"

    def __init__(self, *args: Any, max_staleness: int | None = None, **kwargs: Any):
        """Takes `AgentPipeline`'s arguments (with `lag`, up to ``(lag + 1) * num_groups`` groups generate
        at once; `generation_args(k)` are those of group k, its seed derived from k), and `max_staleness`:
        the most versions a trained group's oldest token may be behind the policy that trains on it (None:
        no bound)."""
        super().__init__(*args, **kwargs)
        self.capacity = (self.lag + 1) * self.num_groups
        self.max_staleness = max_staleness
        self._slots = self.agents.slots(self.num_groups)
        self._condition = threading.Condition()
        # Guarded by _condition:
        self._running: set[int] = set()
        self._ready: dict[int, RolloutGroup] = {}  # complete, untaken, in completion order
        self._next_index = 0
        self._new_left = 0  # groups still to launch for the run's steps
        self._held = 0  # groups of the step training now: their room frees once its weights serve
        self._latest_state: AgentState = {}  # the agents' state after the newest launch
        self._failure: BaseException | None = None
        self._closed = False
        self._metrics: Counter[str] = Counter()
        self._launches: dict[int, Launch] = {}  # untrained groups' launches
        self._redo: list[int] = []  # groups to generate again
        # The trainer's alone:
        self._replay: dict[int, list[RolloutGroup]] = {}  # batches recorded for steps not yet trained
        # Set once the worker runs:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    # -- the trainer's side ----------------------------------------------------------------------

    def start(self, trained_step: int) -> int:
        """Continue after `trained_step` from what the bank holds, and start generating.

        Returns how many recorded batches are trained again as they were."""
        records = self.bank.read_partial()
        later = sorted(s for s in records.batches if s > trained_step)
        self._replay = {s: [records.groups[k] for k in records.batches[s]] for s in later}
        # Batches up to `trained_step` were trained, even where the checkpoint was cut off before it
        # compacted the bank.
        done = {k for indices in records.batches.values() for k in indices}
        pending = set(records.pending) - done
        for index, group in records.groups.items():
            # A group that failed for a dead server (inference, its environment's) is generated again
            # rather than trained.
            if index in pending and not any(
                failed_in_inference(r) or failed_unreachable(r) for r in group.rollouts
            ):
                self._ready[index] = group
        self._launches = {k: launch for launch in records.launches for k in launch.indices if k in pending}
        lost = pending - set(self._ready)
        self._redo = sorted(lost)
        self._running.update(lost)
        if lost:
            self._metrics["rollout/regenerated_after_interruption"] = len(lost)
        if records.agent_state is not None:
            self.agents.load_state_dict(records.agent_state)
        # Indices name groups and derive their seeds: without launch records, none is in use.
        self._next_index = records.next_index or trained_step * self.num_groups
        self._latest_state = self.agents.state_dict()
        steps_left = self.last_step - trained_step - len(self._replay)
        self._new_left = max(0, steps_left * self.num_groups - len(self._ready) - len(lost))
        self._worker.submit(contextvars.copy_context().run, self._work)
        return len(self._replay)

    def get(self, step: int) -> list[RolloutGroup]:
        """The groups of training step `step`: the first `num_groups` to complete (waits for them)."""
        if step in self._replay:
            return self._replay.pop(step)
        started = time.time()
        with self._condition:
            while True:
                if self._failure is not None:
                    raise self._failure
                self._regenerate_stale(step)
                if len(self._ready) >= self.num_groups:
                    break
                with abandonable():
                    self._condition.wait()
            indices = list(self._ready)[: self.num_groups]
            groups = [self._ready.pop(k) for k in indices]
            for index in indices:
                del self._launches[index]
            self._held = len(indices)
            self._metrics["rollout/groups_complete_left"] = len(self._ready)
            self._metrics["rollout/groups_running"] = len(self._running)
        refusal = self.checks.refusal(step, groups, started)
        if refusal is not None:  # nothing of it is kept: a rerun generates these groups again
            self.bank.append_record({"redo": indices})
            self._fail(refusal)
            raise refusal
        self.bank.append_record({"batch": step, "indices": indices})
        return groups

    def wait_ahead(self) -> None:
        """Nothing to wait for (generation never pauses for a sync); raises a failure of the generator."""
        with self._condition:
            if self._failure is not None:
                raise self._failure

    def submit_ahead(self, trained_step: int) -> None:
        """The weights of `trained_step` serve: the room of its batch goes to new groups."""
        del trained_step
        with self._condition:
            self._held = 0
        self._wake_worker()

    def agent_state(self, trained_step: int) -> AgentState:
        """The agents' state after the newest launch (a resume without launch records in the bank
        continues from there)."""
        del trained_step
        with self._condition:
            return self._latest_state

    def pop_metrics(self) -> dict[str, float]:
        """Groups generated again (stale, or lost to an interruption) since the last call, and the pool
        as the last batch left it."""
        with self._condition:
            metrics = {key: float(value) for key, value in self._metrics.items()}
            self._metrics = Counter()
        if self.max_staleness is not None:
            metrics.setdefault("rollout/stale_regenerated", 0.0)
        return metrics

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._wake_worker()
        super().close()

    def _regenerate_stale(self, step: int) -> None:
        """Condition held: the complete groups too old for the batch of `step` (trained on the weights of
        step - 1) are generated again, for the same problems."""
        if self.max_staleness is None:
            return
        oldest = step - 1 - self.max_staleness
        stale = [k for k, group in self._ready.items() if _oldest_version(group) < oldest]
        if not stale:
            return
        for index in stale:
            del self._ready[index]
        self.bank.append_record({"redo": stale})
        self._redo += stale
        self._running.update(stale)
        self._metrics["rollout/stale_regenerated"] += len(stale)
        self._wake_worker()

    def _fail(self, error: BaseException) -> None:
        with self._condition:
            if self._failure is None:
                self._failure = error
            self._closed = True
            self._condition.notify_all()
        self._wake_worker()

    def _wake_worker(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop has closed: nothing left to wake
                pass

    # -- the worker ------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            run_in_new_loop(self._generate())
        except BaseException as exc:  # noqa: BLE001 - reported to the trainer by `get`
            log.debug("partial rollouts stopped", exc_info=True)
            self._fail(exc)

    async def _generate(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            while True:
                with self._condition:
                    if self._closed:
                        return
                    due = self._due()
                    redo, self._redo = self._redo, []
                    redraws = [(self._launches[k], k) for k in redo]
                for launch, index in redraws:
                    tasks |= await self._redraw(launch, index)
                if due:
                    tasks |= await self._launch(due)
                done, _ = await asyncio.wait({*tasks, woken}, return_when=asyncio.FIRST_COMPLETED)
                tasks -= done
                for task in done - {woken}:
                    task.result()  # a failure here stops the run
                if woken in done:
                    self._wake.clear()
                    woken = asyncio.ensure_future(self._wake.wait())
        finally:
            for task in [*tasks, woken]:
                task.cancel()
            await asyncio.gather(*tasks, woken, return_exceptions=True)

    def _due(self) -> list[int]:
        """Condition held: the indices of the groups to launch now, as far as the room allows."""
        room = self.capacity - len(self._running) - len(self._ready) - self._held
        count = max(0, min(room, self._new_left))
        due = list(range(self._next_index, self._next_index + count))
        self._next_index += count
        self._new_left -= count
        self._running.update(due)
        return due

    async def _launch(self, indices: list[int]) -> set[asyncio.Task[None]]:
        """Start the groups at `indices` together (one prefill for their prompts)."""
        before = self.agents.state_dict()
        tasks = await self._start_groups(indices)
        state = self.agents.state_dict()
        self.bank.append_record({"launch": indices, "pending": indices, "before": before, "agents": state})
        launch = Launch(indices, before)
        with self._condition:
            self._latest_state = state
            self._launches.update(dict.fromkeys(indices, launch))
        return set(tasks.values())

    async def _redraw(self, launch: Launch, wanted: int) -> set[asyncio.Task[None]]:
        """Start `launch` again from the agents' state before it, so that each group draws the problem
        it had, and keep group `wanted` (the others are cancelled before they generate)."""
        current = self.agents.state_dict()
        self.agents.load_state_dict(launch.before)
        tasks = await self._start_groups(launch.indices)
        self.agents.load_state_dict(current)
        for index, task in tasks.items():
            if index != wanted:
                task.cancel()
        return {tasks[wanted]}

    async def _start_groups(self, indices: list[int]) -> dict[int, asyncio.Task[None]]:
        tasks = {
            index: asyncio.ensure_future(self._run_group(index, self._slots[index % self.num_groups]))
            for index in indices
        }
        await asyncio.sleep(0)  # each group's first step, in order: its agent draws the problem
        return tasks

    async def _run_group(self, index: int, slot: int) -> None:
        group = await self.agents.one_group(
            slot, self.inference, self.group_size, self.generation_args(index)
        )
        self.bank.append_record({"group": index, "rollouts": group.model_dump(mode="json")})
        with self._condition:
            self._running.discard(index)
            self._ready[index] = group
            self._condition.notify_all()


def _oldest_version(group: RolloutGroup) -> float:
    versions = [r.policy_version for r in group.rollouts if r.is_valid]
    return min(versions) if versions else float("inf")
