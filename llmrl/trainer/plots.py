"""Training curves of a run as one PNG: training reward on the left, held-out evaluation on the right.

Drawn on a bare `matplotlib.figure.Figure` with the Agg canvas, so plotting never touches pyplot's
global figure registry or the interactive backend (safe in a training process and in threads).
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from llmrl.files import atomic_write

_ENV_REWARD_KEY = re.compile(r"reward/(?P<env>.+)/mean")
_EVAL_KEY = re.compile(r"eval/(?P<env>.+)/(?P<metric>pass@\d+|greedy_accuracy)")
_EVAL_MARKERS = {"greedy_accuracy": "s"}  # pass@k curves use circles
_LIGHT_GREY = "0.5"
# Training curves get point markers while they are this short, so that a run's first step or two
# (a single point has no line to draw) is visible.
_MARKED_CURVE_MAX_POINTS = 50

Series = tuple[list[float], list[float]]
"""(steps, values) of one metric, ordered by step; non-finite values are NaN (a gap in the line)."""


def _series(metrics: Sequence[Mapping[str, float]], key: str) -> Series:
    points = sorted((row["step"], float(row[key])) for row in metrics if key in row)
    steps = [step for step, _ in points]
    values = [value if math.isfinite(value) else math.nan for _, value in points]
    return steps, values


def _eval_sort_key(match: re.Match[str]) -> tuple[str, int, int]:
    """Order an environment's eval curves as pass@1, pass@2, ..., then greedy accuracy."""
    metric = match["metric"]
    if metric == "greedy_accuracy":
        return match["env"], 1, 0
    return match["env"], 0, int(metric.removeprefix("pass@"))


def _say_empty(axes: Axes, text: str) -> None:
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes, color=_LIGHT_GREY)
    axes.set_xticks([])
    axes.set_yticks([])


def _label_axes(axes: Axes, y_label: str) -> None:
    axes.set_xlabel("step")
    axes.set_ylabel(y_label)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)


def _draw_training_reward(axes: Axes, metrics: Sequence[Mapping[str, float]], keys: set[str]) -> None:
    axes.set_title("training reward")
    env_keys = sorted(key for key in keys if _ENV_REWARD_KEY.fullmatch(key))
    curves = []
    if "reward/mean" in keys:
        curves.append(("all environments", "reward/mean"))
    # With one environment its curve is the overall one; draw it only when there is no overall curve.
    if len(env_keys) > 1 or not curves:
        curves += [(_ENV_REWARD_KEY.fullmatch(key)["env"], key) for key in env_keys]
    if not curves:
        _say_empty(axes, "no training steps yet")
        return
    for label, key in curves:
        steps, values = _series(metrics, key)
        style = {"color": "black", "linewidth": 2.0} if key == "reward/mean" else {"linewidth": 1.2}
        marker = "." if len(steps) <= _MARKED_CURVE_MAX_POINTS else None
        axes.plot(steps, values, label=label, marker=marker, **style)
    _label_axes(axes, "mean reward")
    if len(curves) > 1:
        axes.legend(fontsize="small")


def _draw_evaluation(axes: Axes, metrics: Sequence[Mapping[str, float]], keys: set[str]) -> None:
    axes.set_title("held-out evaluation")
    matches = sorted((m for key in keys if (m := _EVAL_KEY.fullmatch(key))), key=_eval_sort_key)
    if not matches:
        _say_empty(axes, "no evaluation yet")
        return
    env_colors = {}
    for match in matches:
        env_colors.setdefault(match["env"], f"C{len(env_colors) % 10}")
    for match in matches:
        steps, values = _series(metrics, match.string)
        axes.plot(
            steps,
            values,
            label=f"{match['env']} {match['metric']}",
            color=env_colors[match["env"]],
            marker=_EVAL_MARKERS.get(match["metric"], "o"),
            linestyle="--" if match["metric"] == "greedy_accuracy" else "-",
        )
    _label_axes(axes, "accuracy")
    axes.set_ylim(-0.03, 1.03)  # pass@k and greedy accuracy are fractions; a fixed scale compares runs
    axes.legend(fontsize="small")


def plot_curves(
    metrics: Sequence[Mapping[str, float]], output: str | Path, *, title: str | None = None
) -> Path:
    """Draw a run's curves into the PNG `output` (replaced atomically) and return its path.

    `metrics` are rows as `llmrl.telemetry.read_metrics` returns them: each has "step", any subset of
    metric keys, and NaN for values that were not finite. Left panel: `reward/mean` against step, plus
    one curve per environment (`reward/<env>/mean`) when there are several. Right panel: every
    `eval/<env>/pass@<k>` and `eval/<env>/greedy_accuracy`, with markers, or "no evaluation yet".
    """
    output = Path(output)
    keys = {key for row in metrics for key in row}
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    reward_axes, eval_axes = figure.subplots(1, 2)
    _draw_training_reward(reward_axes, metrics, keys)
    _draw_evaluation(eval_axes, metrics, keys)
    if title is not None:
        figure.suptitle(title)
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=100)
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(output, png.getvalue())
    return output
