"""The contract between the trainer and whatever gives it each step's rollout groups: `RolloutSource`.

The trainer holds one source for the whole run, whatever the mode, and calls it in this order::

    banked = source.start(trained_step)      once: continue after the checkpoint's step
    for each step t:
        groups = source.get(t)               the batch that trains step t
        ...                                  the update
        source.wait_ahead()                  before the weights change
        ...                                  the weight sync: the weights of t serve
        source.submit_ahead(t)               what those weights are to generate
    source.agent_state(t)                    with every checkpoint of step t
    source.close()

Three sources implement it: `RolloutPipeline` (each step's groups drawn together, at most `lag` steps
ahead: `llmrl.rollouts.synchronous`), `PartialRolloutPipeline` (groups drawn continuously, a batch of
whichever complete first: `llmrl.rollouts.partial`) and, on the ranks other than 0 of a torchrun run,
`ReceivedRollouts`, which takes what rank 0's source broadcasts (`llmrl.rollouts.ranks`). The two
pipelines share `AgentPipeline`: the agents, the inference interface they draw through, the batch
checks, the rollout bank and one worker thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from llmrl.agents.multi_task import WeightedMultiTask
from llmrl.inference.interface import InferenceInterface
from llmrl.rollouts.bank import RolloutBank
from llmrl.rollouts.checks import BatchChecks
from llmrl.types import GenerationArgs, RolloutGroup

AgentState = dict[str, Any]


class RolloutSource(ABC):
    """Each training step's rollout groups, as the trainer asks for them (see the module docstring)."""

    @abstractmethod
    def start(self, trained_step: int) -> int:
        """Continue after `trained_step` (0 for a new run); returns how many batches generated before an
        interruption are trained on first."""

    @abstractmethod
    def get(self, step: int) -> list[RolloutGroup]:
        """The groups of training step `step` (waits for them)."""

    @abstractmethod
    def wait_ahead(self) -> None:
        """Called before the weights that generate change; raises a failure of what runs ahead."""

    @abstractmethod
    def submit_ahead(self, trained_step: int) -> None:
        """The weights of `trained_step` serve now: what they are to generate may start."""

    @abstractmethod
    def agent_state(self, trained_step: int) -> AgentState:
        """The agents' state that a checkpoint of `trained_step` saves (asked on rank 0 alone)."""

    def pop_metrics(self) -> dict[str, float]:
        """The source's own metrics since the last call."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Stop whatever still generates; called once, however the run ends."""


class AgentPipeline(RolloutSource):
    """What both pipelines share: `agents` draw groups of `group_size` rollouts through `inference`,
    `num_groups` a step, for training steps up to `last_step`, at most `lag` steps ahead of training, on
    one worker thread; each batch passes the checks (`BatchChecks`) before it is banked or trained on.

    `generation_args(k)` gives the sampling options (with their seed) of the k-th draw: a step's batch
    or a single group, as the pipeline draws.
    """

    thread_name: ClassVar[str]

    def __init__(
        self,
        agents: WeightedMultiTask,
        inference: InferenceInterface,
        *,
        num_groups: int,
        group_size: int,
        generation_args: Callable[[int], GenerationArgs],
        lag: int,
        last_step: int,
        bank: RolloutBank,
        max_inference_failure_frac: float | None = None,
        max_user_failure_frac: float | None = None,
    ):
        self.agents = agents
        self.inference = inference
        self.num_groups = num_groups
        self.group_size = group_size
        self.generation_args = generation_args
        self.lag = lag
        self.last_step = last_step
        self.bank = bank
        self.checks = BatchChecks(inference, max_inference_failure_frac, max_user_failure_frac)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.thread_name)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
