"""Evaluation during training: when it is due, which rank runs it, and the seed it samples with.

Rank 0 alone holds the agents and the inference side, so it evaluates; over several processes the
other ranks record an empty summary and go on to wait for rank 0's next broadcast. Every evaluation
samples with the same seed, derived once from the run's: differences between steps come from the
weights. The summaries are kept by step, checkpointed with the run, and give the run's summary its
first and last evaluation.
"""

from __future__ import annotations

from typing import Any

from llmrl.agents import WeightedMultiTask
from llmrl.config import EvaluationConfig
from llmrl.evaluation import Summary, evaluate_environments
from llmrl.inference import InferenceInterface, run_sync
from llmrl.seeding import derive_seed
from llmrl.telemetry import trace_span
from llmrl.types import GenerationArgs

_HEADLINE = ("pass@1", "greedy_accuracy")
"""The metrics an evaluation's line shows."""


class Evaluator:
    """Evaluates the policy on every environment's held-out problems, as `settings` ask."""

    def __init__(
        self, agents: WeightedMultiTask | None, settings: EvaluationConfig, generation_args: GenerationArgs
    ):
        """
        Args:
            agents: rank 0's; None on the other ranks, which evaluate nothing.
            settings: when to evaluate and on how many problems.
            generation_args: the run's sampling options, with its seed.
        """
        self.agents = agents
        self.settings = settings
        self.generation_args = generation_args.merge(
            GenerationArgs(seed=derive_seed(generation_args.seed, "evaluation"))
        )
        self.evaluations: dict[int, Summary] = {}
        """The summary of each evaluated step (empty on ranks other than 0)."""

    def due_at_start(self, step: int) -> bool:
        return step == 0 and self.settings.at_start and 0 not in self.evaluations

    def due_after(self, step: int, last_step: int) -> bool:
        every = self.settings.every
        return (every > 0 and step % every == 0) or (step == last_step and self.settings.at_end)

    def missing_at_end(self, step: int) -> bool:
        """Whether the run ends at `step` (e.g. ``training.steps: 0``) without its last evaluation."""
        return self.settings.at_end and step not in self.evaluations

    def evaluate(self, step: int, inference: InferenceInterface | None) -> dict[str, float]:
        """Evaluate the weights of `step` (on rank 0); returns its metrics, ``eval/ENV/NAME``."""
        if self.agents is None or inference is None:
            self.evaluations[step] = {}
            return {}
        with trace_span("evaluate", step=step):
            summary = run_sync(
                evaluate_environments(self.agents, inference, self.settings, self.generation_args)
            )
        self.evaluations[step] = summary
        return {
            f"eval/{env}/{name}": value for env, metrics in summary.items() for name, value in metrics.items()
        }

    def endpoints(self, last_step: int) -> dict[str, Any]:
        """The first evaluation and the one of `last_step`, as the run's summary names them."""
        last = max(self.evaluations, default=None)
        return {
            "eval_start": self.evaluations.get(0, {}),
            "eval_end": self.evaluations[last] if last is not None and last == last_step else {},
        }

    def line(self, step: int) -> str:
        """The evaluation of `step` in one line of the progress display, with the samples that failed
        (not scored, and not counted in any training step's failures) where some did."""
        parts = []
        for env, metrics in self.evaluations[step].items():
            shown = [f"{name} {metrics[name]:.3f}" for name in _HEADLINE if name in metrics]
            if metrics.get("failed_samples"):
                shown.append(f"{metrics['failed_samples']:.0f} failed samples")
            parts.append(f"{env}: {', '.join(shown)}")
        when = "before training (step 0)" if step == 0 else f"at step {step}"
        return f"evaluation {when}: " + "; ".join(parts)
