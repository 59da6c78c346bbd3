"""The rollout source a run's config asks for (`rollout_source`)."""

from __future__ import annotations

from pathlib import Path

from llmrl.agents.multi_task import WeightedMultiTask
from llmrl.config import RunConfig
from llmrl.inference.interface import InferenceInterface
from llmrl.rollouts.bank import RolloutBank
from llmrl.rollouts.partial import PartialRolloutPipeline
from llmrl.rollouts.ranks import Ranks, rollouts_on_every_rank
from llmrl.rollouts.source import AgentPipeline, RolloutSource
from llmrl.rollouts.synchronous import RolloutPipeline
from llmrl.seeding import derive_seed
from llmrl.types import GenerationArgs


def rollout_source(
    config: RunConfig,
    ranks: Ranks,
    agents: WeightedMultiTask | None,
    inference: InferenceInterface | None,
    generation_args: GenerationArgs,
) -> RolloutSource:
    """This rank's source of the run's batches: on rank 0 the pipeline `config.training` asks for, drawing
    from `agents` through `inference` with `generation_args` (a seed of their own per step, or per group
    with partial rollouts); on the others what rank 0 broadcasts."""

    def pipeline() -> AgentPipeline:
        assert agents is not None and inference is not None  # rank 0 has both
        training = config.training

        def seeded(*keys: object) -> GenerationArgs:
            return generation_args.merge(GenerationArgs(seed=derive_seed(generation_args.seed, *keys)))

        common = dict(
            num_groups=training.prompts_per_step,
            group_size=training.group_size,
            lag=training.generation_lag,
            last_step=training.steps,
            bank=RolloutBank(Path(config.run_dir)),
            max_inference_failure_frac=training.max_inference_failure_frac,
            max_user_failure_frac=training.max_user_failure_frac,
        )
        if training.partial_rollouts:
            return PartialRolloutPipeline(
                agents,
                inference,
                generation_args=lambda index: seeded("group", index),
                max_staleness=training.max_staleness,
                **common,
            )
        return RolloutPipeline(
            agents,
            inference,
            generation_args=lambda step: seeded("step", step),
            in_flight=config.inference.weight_update == "in_flight",
            **common,
        )

    return rollouts_on_every_rank(ranks, pipeline)
