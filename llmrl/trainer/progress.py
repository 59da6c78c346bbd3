"""Live progress of an RL run: a rich progress bar on a terminal, one plain line per step elsewhere.

`ProgressDisplay` shows step k/N and, when the step's metrics carry them, mean reward, pass rate, the
KL to the reference (a run with a KL term), tokens per second and seconds per step; the rich bar adds
elapsed time and an ETA. Lines passed to `message` (evaluation summaries, checkpoint notices) appear
above the bar.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Literal, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

DisplayMode = Literal["auto", "rich", "plain", "off"]

# (label, metric keys tried in order, format spec, label goes after the value)
_SHOWN_METRICS: tuple[tuple[str, tuple[str, ...], str, bool], ...] = (
    ("reward", ("reward/mean",), ".3f", False),
    ("pass", ("reward/pass_rate",), ".3f", False),
    # Not `train/kl`, which a run without a KL term fills with KL(pi_old || pi): 0 with one mini-batch.
    ("kl", ("train/ref_kl",), ".2g", False),
    ("tok/s", ("perf/tokens_per_s",), ".0f", False),
    ("s/step", ("time/step_s",), ".3g", True),
)


def format_metrics(metrics: Mapping[str, float]) -> str:
    """The headline metrics of one step as `reward 0.412  pass 0.375  kl 0.0012  tok/s 5123  1.8 s/step`.

    Metrics missing from `metrics` are left out; NaN shows as `nan`.
    """
    parts = []
    for label, keys, spec, label_after in _SHOWN_METRICS:
        key = next((key for key in keys if key in metrics), None)
        if key is None:
            continue
        text = format(float(metrics[key]), spec)
        parts.append(f"{text} {label}" if label_after else f"{label} {text}")
    return "  ".join(parts)


def _format_duration(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def _is_interactive(stream: TextIO) -> bool:
    """Whether `stream` is a terminal outside CI (CI logs keep every redraw of a live bar)."""
    if os.environ.get("CI"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ProgressDisplay:
    """Progress of `total_steps` RL steps, updated after each step.

    `mode`: "rich" draws a live bar (on a stream that is not a terminal, rich prints only the final
    bar, at `close`); "plain" prints one flushed line per step; "off" prints nothing at all; "auto"
    picks "rich" when `stream` is a terminal and the `CI` environment variable is unset, else "plain".
    `start_step` is the last step already done (a resumed run), so the counter and ETA start from it.
    Use as a context manager or call `close`; updating a closed display is a `ValueError`.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        start_step: int = 0,
        mode: DisplayMode = "auto",
        stream: TextIO | None = None,
    ):
        if total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {total_steps}")
        if not 0 <= start_step <= total_steps:
            raise ValueError(f"start_step must be in [0, total_steps={total_steps}], got {start_step}")
        if mode not in ("auto", "rich", "plain", "off"):
            raise ValueError(f"mode must be 'auto', 'rich', 'plain' or 'off', got {mode!r}")
        self.total_steps = total_steps
        self.start_step = start_step
        self._stream = sys.stdout if stream is None else stream
        if mode == "auto":
            mode = "rich" if _is_interactive(self._stream) else "plain"
        self._mode: Literal["rich", "plain", "off"] = mode
        self._started_at = time.monotonic()
        self._closed = False
        self._progress: Progress | None = None
        if self._mode == "rich":
            self._progress = Progress(
                TextColumn("{task.fields[counter]}", markup=False),
                BarColumn(bar_width=24),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}", markup=False),
                # The metrics go last and wrap onto more lines on a narrow terminal, rather than
                # squeezing the bar and the times out of the row.
                TextColumn("{task.fields[metrics]}", markup=False, table_column=Column(no_wrap=False)),
                console=Console(file=self._stream),
            )
            self._task = self._progress.add_task(
                "train",
                total=total_steps,
                completed=start_step,
                counter=self._counter(start_step),
                metrics="",
                eta=self._eta(start_step),
            )
            self._progress.start()

    @property
    def mode(self) -> Literal["rich", "plain", "off"]:
        """The mode in use ("auto" resolved)."""
        return self._mode

    def _counter(self, step: int) -> str:
        return f"step {step}/{self.total_steps}"

    def _eta(self, step: int) -> str:
        """Time left at the mean pace of the steps run by this process (a resume's earlier steps excluded)."""
        steps_done_here = step - self.start_step
        if steps_done_here <= 0:
            return "-:--:--"
        seconds_per_step = (time.monotonic() - self._started_at) / steps_done_here
        return _format_duration(seconds_per_step * max(self.total_steps - step, 0))

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("ProgressDisplay is closed")

    def _print_line(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Show that RL step `step` (1-based) finished, with its headline `metrics`."""
        self._check_open()
        summary = format_metrics(metrics)
        if self._progress is not None:
            self._progress.update(
                self._task, completed=step, counter=self._counter(step), metrics=summary, eta=self._eta(step)
            )
        elif self._mode == "plain":
            self._print_line(f"{self._counter(step)}  {summary}" if summary else self._counter(step))

    def message(self, text: str) -> None:
        """Print `text` as its own line (above the bar in rich mode)."""
        self._check_open()
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        elif self._mode == "plain":
            self._print_line(text)

    def close(self) -> None:
        """Stop the live bar, leaving its last state on screen. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
