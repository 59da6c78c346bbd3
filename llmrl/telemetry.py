"""What a run writes down: metrics, rollout texts and a timeline of where the time went.

- `MetricsLogger`: one `log(step, metrics)` fanning out to `metrics.jsonl` (always), TensorBoard
  (default on) and Weights & Biases (optional, offline by default).
- `RolloutLog`: one JSON line per rollout (prompt, completion, reward, status, ...).
- `Tracer`: named spans saved as a Chrome-trace JSON file ("Trace Event Format",
  https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU), viewable in
  https://ui.perfetto.dev or chrome://tracing, plus the total seconds spent in each span name.

JSONL files are written one whole line per `write` and flushed at once, so a killed process loses at
most the line it was writing. Readers skip such a torn last line; writers drop it before appending.
On resume from a checkpoint at step N, `resume_step=N` drops the lines of steps > N first, so the
re-run steps are not recorded twice (TensorBoard gets the same via `purge_step`).

Non-finite metric values (NaN, inf) are kept in the JSONL as `null` (read back as NaN by
`read_metrics`), so the file shows when they happened; TensorBoard and W&B skip them because a
single NaN spoils their smoothed curves. Non-numeric metric values are a `ValueError`.

This module is `llmrl.telemetry`; it never imports the standard `logging` module by a relative name.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import json
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmrl.files import atomic_write
from llmrl.types import TokenRollout

JsonRecord = dict[str, Any]

log = logging.getLogger(__name__)


def _json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _json_line(record: JsonRecord) -> str:
    return json.dumps(_json_safe(record), allow_nan=False, ensure_ascii=False) + "\n"


def read_jsonl(
    path: str | Path, parse: Callable[[Any], Any] | None = None, *, skip_bad_lines: bool = False
) -> list[Any]:
    """The records of a JSONL file, each passed through `parse` when given.

    The piece after the last newline, when it does not parse, is a line a crash tore mid-write: it is
    skipped with a warning. Any other line that is not JSON, or that `parse` rejects (`ValueError`,
    `KeyError`, `TypeError`), is a `ValueError` naming it, or with `skip_bad_lines` a warning."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            records.append(record if parse is None else parse(record))
        except (ValueError, KeyError, TypeError) as error:  # json.JSONDecodeError is a ValueError
            torn = number == len(lines)  # only the unterminated last piece can be torn
            if not (torn or skip_bad_lines):
                raise ValueError(f"{path}:{number}: not a valid record ({error})") from error
            log.warning("%s:%d: skipped a %s line (%r)", path, number, "torn" if torn else "corrupt", error)
    return records


def ends_with_newline(path: str | Path) -> bool:
    """Whether appending to `path` starts a new line: it is missing, empty or ends in a newline."""
    path = Path(path)
    if not path.exists():
        return True
    with path.open("rb") as file:
        if file.seek(0, os.SEEK_END) == 0:
            return True
        file.seek(-1, os.SEEK_END)
        return file.read(1) == b"\n"


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The records of a `metrics.jsonl`, with `null` (a non-finite value when logged) read as NaN."""
    return [
        {key: math.nan if value is None else value for key, value in record.items()}
        for record in read_jsonl(path)
    ]


class _JsonlAppender:
    """Appends records to a JSONL file, one flushed line each. On open, drops a torn last line and,
    when `resume_step` is given, the records of later steps."""

    def __init__(self, path: str | Path, resume_step: int | None = None):
        if resume_step is not None:
            _check_step(resume_step, "resume_step")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and (resume_step is not None or not ends_with_newline(self.path)):
            kept = [r for r in read_jsonl(self.path) if resume_step is None or r["step"] <= resume_step]
            atomic_write(self.path, "".join(_json_line(r) for r in kept))
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: JsonRecord) -> None:
        line = _json_line(record)
        with self._lock:
            if self._file.closed:
                raise ValueError(f"{self.path} is closed; cannot write to it")
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _check_step(step: int, name: str = "step") -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{name}: expected an integer >= 0, got {step!r}")


def _as_float(key: str, value: Any) -> float:
    """A metric value as a float: Python and NumPy numbers, one-element tensors and arrays."""
    if hasattr(value, "__float__"):  # str has no __float__, so "1.5" is refused rather than parsed
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            pass  # e.g. a tensor with several elements
    raise ValueError(f"metrics[{key!r}]: expected a number, got {type(value).__name__} {value!r}")


class MetricsLogger:
    """Fans `log(step, metrics)` out to `run_dir/metrics.jsonl`, TensorBoard and Weights & Biases.

    `resume_step=N` (resuming from a checkpoint at step N) drops the JSONL lines of steps > N and
    purges TensorBoard events from step N+1 on. `config` is the resolved run config given to W&B.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "llmrl",
        wandb_mode: str = "offline",
        config: dict[str, Any] | None = None,
        resume_step: int | None = None,
    ):
        if wandb_mode not in ("online", "offline", "disabled"):
            raise ValueError(f"wandb_mode: expected 'online', 'offline' or 'disabled', got {wandb_mode!r}")
        self.run_dir = Path(run_dir)
        wandb_module = _import_wandb() if wandb else None  # fail before creating any file
        self._jsonl = _JsonlAppender(self.run_dir / "metrics.jsonl", resume_step)  # checks resume_step
        self._tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only when asked for

            purge_step = None if resume_step is None else resume_step + 1
            log_dir = str(self.run_dir / "tensorboard")
            self._tensorboard = SummaryWriter(log_dir=log_dir, purge_step=purge_step)
        self._wandb_run = None
        if wandb_module is not None:
            self._wandb_run = wandb_module.init(
                project=wandb_project, mode=wandb_mode, dir=str(self.run_dir), config=config or {}
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record `metrics` (name -> number) at `step`. Names may use `/` to group (`reward/mean`)."""
        _check_step(step)
        if "step" in metrics:
            raise ValueError("metrics: 'step' is reserved for the step number; rename that metric")
        values = {key: _as_float(key, value) for key, value in metrics.items()}
        self._jsonl.write({"step": step, **values})
        finite = {key: value for key, value in values.items() if math.isfinite(value)}
        if self._tensorboard is not None:
            for key, value in finite.items():
                self._tensorboard.add_scalar(key, value, global_step=step)
            self._tensorboard.flush()  # as durable as the JSONL line; one flush per step is cheap
        if self._wandb_run is not None:
            self._wandb_run.log(finite, step=step)

    def close(self) -> None:
        """Flush and close every sink. Safe to call twice."""
        self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as error:
        raise ImportError(
            "logging.wandb is on but the `wandb` package is not installed: pip install 'llmrl[wandb]'"
        ) from error
    return wandb


class RolloutLog:
    """Appends one JSON line per rollout: step, env_id, problem_id, prompt, completion, reward,
    status, truncated, policy_version (the oldest weight version among its tokens), newest_version,
    failure_reason, then any extra fields.

    The prompt is the trajectory's first segment and the completion the rest joined (model and
    environment turns alike). A `TokenRollout` without decoded `text` logs them as null.
    Plain dicts are written as given, after `step`.
    """

    def __init__(self, path: str | Path, *, resume_step: int | None = None):
        self._jsonl = _JsonlAppender(path, resume_step)

    def log(self, step: int, rollout: TokenRollout | dict[str, Any], **extra: Any) -> None:
        _check_step(step)
        record = {"step": step, **_rollout_record(rollout)}
        clashes = sorted(set(record) & set(extra))
        if clashes:
            raise ValueError(f"extra fields {clashes} clash with the rollout's own fields")
        self._jsonl.write({**record, **extra})

    def close(self) -> None:
        self._jsonl.close()

    def __enter__(self) -> RolloutLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _rollout_record(rollout: TokenRollout | dict[str, Any]) -> JsonRecord:
    if isinstance(rollout, dict):
        if "step" in rollout:
            raise ValueError("rollout: 'step' is reserved for the step number given to log()")
        return rollout
    segments = rollout.text
    return {
        "env_id": rollout.env_id,
        "problem_id": rollout.problem_id,
        "prompt": segments[0] if segments else None,
        "completion": "".join(segments[1:]) if segments else None,
        "reward": rollout.reward,
        "status": rollout.status,
        "truncated": rollout.truncated,
        "policy_version": rollout.policy_version,
        "newest_version": rollout.newest_version,
        "failure_reason": rollout.failure_reason,
    }


class _Span:
    """Context manager timing one span; `__slots__` and no generator keep it cheap."""

    __slots__ = ("_tracer", "_name", "_args", "_start_ns")

    def __init__(self, tracer: Tracer, name: str, args: dict[str, Any]):
        self._tracer, self._name, self._args = tracer, name, args

    def __enter__(self) -> _Span:
        self._start_ns = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        end_ns = time.perf_counter_ns()
        if exc_type is not None:
            self._args["error"] = exc_type.__name__
        self._tracer._record_span(self._name, self._args, self._start_ns, end_ns)


class Tracer:
    """A timeline of named spans, saved as Chrome-trace JSON (`{"traceEvents": [...]}`).

    Spans are complete events (`"ph": "X"`, `ts`/`dur` in microseconds since the Unix epoch, so
    traces of several processes line up). Each thread, and each asyncio task, gets its own track:
    spans nest within a track, and concurrent tasks show side by side instead of overlapping.

    `durations()` gives the seconds spent in each span name; it is kept even when `enabled` is
    False (the trainer logs time per phase from it), which then only skips the event list and file.
    Durations of concurrent or nested spans of one name add up (busy time, not wall time).
    At most `max_events` events are kept; later ones are counted in the file's `otherData`.
    """

    def __init__(self, path: str | Path, enabled: bool = True, *, max_events: int = 1_000_000):
        if max_events < 1:
            raise ValueError(f"max_events: expected an integer >= 1, got {max_events!r}")
        self.path = Path(path)
        self.enabled = enabled
        self._max_events = max_events
        self._lock = threading.Lock()
        self._pid = os.getpid()
        # perf_counter is monotonic and precise; the epoch offset only anchors it to wall time.
        self._epoch_us = time.time_ns() / 1000 - time.perf_counter_ns() / 1000
        self._events: list[JsonRecord] = []
        self._dropped_events = 0
        self._durations: dict[str, float] = {}
        self._track_ids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next_track_id = itertools.count(1)  # never reused, unlike the size of _track_ids
        self._add_event({"name": "process_name", "ph": "M", "pid": self._pid, "args": {"name": "llmrl"}})

    def span(self, name: str, **args: Any) -> _Span:
        """`with tracer.span("generate", step=3):` records the block as one span with `args`."""
        return _Span(self, name, args)

    def instant(self, name: str, **args: Any) -> None:
        """A point in time on the current track (e.g. "weights synced")."""
        if self.enabled:
            with self._lock:
                event = {"name": name, "ph": "i", "s": "t", "ts": self._now_us(), "pid": self._pid}
                self._add_event({**event, "tid": self._track_id(), "args": _json_safe(args)})

    def counter(self, name: str, values: dict[str, float]) -> None:
        """A sample of one or more series drawn as a stacked chart (e.g. {"queued": 3, "running": 8})."""
        if self.enabled:
            with self._lock:
                event = {"name": name, "ph": "C", "ts": self._now_us(), "pid": self._pid}
                self._add_event({**event, "args": _json_safe(dict(values))})

    def durations(self, reset: bool = False) -> dict[str, float]:
        """Seconds spent in spans of each name since the start or the last `reset=True` call."""
        with self._lock:
            durations = dict(self._durations)
            if reset:
                self._durations.clear()
        return durations

    def save(self) -> None:
        """Write the events so far to `path`, atomically; call as often as you like. No-op if disabled."""
        if not self.enabled:
            return
        with self._lock:
            events = list(self._events)
            other_data = {"dropped_events": self._dropped_events}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other_data}
        atomic_write(self.path, json.dumps(trace, default=str, allow_nan=False))

    def _record_span(self, name: str, args: dict[str, Any], start_ns: int, end_ns: int) -> None:
        with self._lock:
            self._durations[name] = self._durations.get(name, 0.0) + (end_ns - start_ns) / 1e9
            if self.enabled:
                event = {"name": name, "ph": "X", "ts": self._epoch_us + start_ns / 1000}
                event["dur"] = (end_ns - start_ns) / 1000
                event.update(pid=self._pid, tid=self._track_id(), args=_json_safe(args))
                self._add_event(event)

    def _now_us(self) -> float:
        return self._epoch_us + time.perf_counter_ns() / 1000

    def _add_event(self, event: JsonRecord) -> None:
        if len(self._events) < self._max_events:
            self._events.append(event)
        else:
            self._dropped_events += 1

    def _track_id(self) -> int:
        """The current asyncio task's track, or else the current thread's; named on first use.
        Called under the lock. Keyed weakly, so finished tasks and threads are not kept alive."""
        thread = threading.current_thread()
        try:
            owner = asyncio.current_task() or thread
        except RuntimeError:  # no running event loop in this thread
            owner = thread
        track_id = self._track_ids.get(owner)
        if track_id is None:
            track_id = self._track_ids[owner] = next(self._next_track_id)
            label = thread.name if owner is thread else f"{thread.name} / {owner.get_name()}"
            metadata = {"name": "thread_name", "ph": "M", "pid": self._pid, "tid": track_id}
            self._add_event({**metadata, "args": {"name": label}})
        return track_id


_active_tracer: contextvars.ContextVar[Tracer | None] = contextvars.ContextVar("llmrl_tracer", default=None)


@contextlib.contextmanager
def use_tracer(tracer: Tracer):
    """Make `tracer` the one `trace_span` records into, in this context and the tasks it starts."""
    token = _active_tracer.set(tracer)
    try:
        yield tracer
    finally:
        _active_tracer.reset(token)


def trace_span(name: str, **args: Any) -> contextlib.AbstractContextManager[Any]:
    """A span on the active tracer (see `use_tracer`), or a no-op when there is none.

    Lets code that does not own the tracer, such as agents timing their reward calls, appear on the
    trainer's timeline without being handed the tracer.
    """
    tracer = _active_tracer.get()
    return tracer.span(name, **args) if tracer is not None else contextlib.nullcontext()
