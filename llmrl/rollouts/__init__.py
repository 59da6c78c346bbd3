"""Rollout production: from the agents' groups to the batch each training step trains on.

The trainer holds one `RolloutSource` (`llmrl.rollouts.source`, built from the config by
`rollout_source`) and asks it for each step's groups, then turns them into a `RolloutBatch` with
`prepare_batch`. Rollouts never import the trainer.

| module | what lives there |
|---|---|
| `source` | the `RolloutSource` contract, and `AgentPipeline`: what both pipelines share |
| `synchronous` | `RolloutPipeline`: each step's groups drawn together, at most `training.generation_lag` steps ahead |
| `partial` | `PartialRolloutPipeline`: groups drawn continuously, a batch of whichever complete first |
| `ranks` | under torchrun: rank 0's source broadcasts each batch, the other ranks receive it |
| `build` | `rollout_source`: the source a run's config asks for, on this rank |
| `bank` | `RolloutBank`: every generated batch (or group) on disk until a checkpoint trains past it |
| `checks` | whether a batch may be trained on (inference, environment-server and user-code failures), and the one line a run stops with |
| `batch` | `prepare_batch`: reward shaping, group advantages, the rollouts that reach the loss (`RolloutBatch`) |
| `metrics` | the step's rollout metrics (rewards, pass rates, lengths, failures) and token staleness |
"""

from llmrl.rollouts.bank import BANK_FILE, BankedBatch, RolloutBank
from llmrl.rollouts.batch import RolloutBatch, prepare_batch
from llmrl.rollouts.build import rollout_source
from llmrl.rollouts.checks import (
    BatchChecks,
    UserCodeFailures,
    inference_failure,
    unavailable_line,
    unreachable_environment,
)
from llmrl.rollouts.metrics import rollout_metrics, staleness_metrics
from llmrl.rollouts.partial import PartialRolloutPipeline
from llmrl.rollouts.ranks import BroadcastRollouts, ReceivedRollouts
from llmrl.rollouts.source import AgentPipeline, RolloutSource
from llmrl.rollouts.synchronous import RolloutPipeline

__all__ = [
    "BANK_FILE",
    "AgentPipeline",
    "BankedBatch",
    "BatchChecks",
    "BroadcastRollouts",
    "PartialRolloutPipeline",
    "ReceivedRollouts",
    "RolloutBank",
    "RolloutBatch",
    "RolloutPipeline",
    "RolloutSource",
    "UserCodeFailures",
    "inference_failure",
    "prepare_batch",
    "rollout_metrics",
    "rollout_source",
    "staleness_metrics",
    "unavailable_line",
    "unreachable_environment",
]
