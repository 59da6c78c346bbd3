"""Held-out evaluation of every configured environment: pass@k, greedy accuracy, mean reward.

Shared by `llmrl eval` and the trainer (at the start, every `evaluation.every` steps, at the end).
A sample whose inference or reward failed is not scored as a wrong answer: it is counted in
``failed_samples`` and left out of the other metrics (`llmrl.agents.pass_at_k.evaluation_metrics`).
"""

from __future__ import annotations

import logging

from rich.table import Table

from llmrl.agents import WeightedMultiTask, evaluation_metrics
from llmrl.config import EvaluationConfig
from llmrl.inference.interface import InferenceInterface
from llmrl.types import GenerationArgs

log = logging.getLogger(__name__)

Summary = dict[str, dict[str, float]]
"""env id -> metric name -> value."""


async def evaluate_environments(
    agents: WeightedMultiTask,
    inference: InferenceInterface,
    config: EvaluationConfig,
    generation_args: GenerationArgs,
) -> Summary:
    """Evaluate every environment (training and evaluation-only) on its held-out problems."""
    responses = await agents.evaluate(
        inference,
        config.num_prompts,
        samples_per_prompt=config.samples_per_prompt,
        ks=config.ks,
        greedy=config.greedy,
        correct_threshold=config.correct_threshold,
        generation_args=generation_args,
    )
    summary = {
        env_id: {"problems": float(len(r.results)), **evaluation_metrics(r)}
        for env_id, r in responses.items()
    }
    for env_id, metrics in summary.items():
        if metrics.get("failed_samples"):
            log.warning(
                "%s: %d evaluation sample(s) failed and were not scored (see the warnings above)",
                env_id,
                metrics["failed_samples"],
            )
    return summary


def summary_table(summary: Summary, title: str) -> Table:
    """A rich table with one row per environment and one column per metric."""
    columns = sorted({name for metrics in summary.values() for name in metrics}, key=_metric_order)
    table = Table(title=title)
    table.add_column("env")
    for name in columns:
        table.add_column(name, justify="right")
    for env_id, metrics in summary.items():
        table.add_row(env_id, *(_format(metrics.get(name)) for name in columns))
    return table


def _metric_order(name: str) -> tuple[int, str]:
    order = ["problems", "pass@1", "greedy_accuracy", "accuracy", "reward_mean"]
    return (order.index(name), name) if name in order else (len(order), name)


def _format(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() and value > 1 else f"{value:.3f}"
