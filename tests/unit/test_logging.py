"""Every sink is checked by reading its file back: JSONL lines, TensorBoard events, trace JSON."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from llmrl.telemetry import (
    MetricsLogger,
    RolloutLog,
    Tracer,
    read_jsonl,
    read_metrics,
    trace_span,
    use_tracer,
)
from llmrl.types import TokenRollout


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


# ---------------------------------------------------------------- MetricsLogger


def test_metrics_reach_jsonl_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"train/loss": 1.5, "reward/mean": np.float32(0.25), "tokens": 7})
        logger.log(1, {"train/loss": torch.tensor(0.75), "reward/mean": 0.5, "tokens": True})

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 0, "train/loss": 1.5, "reward/mean": 0.25, "tokens": 7.0},
        {"step": 1, "train/loss": 0.75, "reward/mean": 0.5, "tokens": 1.0},
    ]
    assert tensorboard_scalars(tmp_path, "train/loss") == [(0, 1.5), (1, 0.75)]
    assert tensorboard_scalars(tmp_path, "reward/mean") == [(0, 0.25), (1, 0.5)]


def test_jsonl_line_is_on_disk_before_close(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(3, {"a": 1.0})
    # A crash now must not lose the step: the line is already flushed.
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 3, "a": 1.0}]
    logger.close()
    assert not (tmp_path / "tensorboard").exists()


def test_non_finite_values_are_null_in_jsonl_and_skipped_in_tensorboard(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"kl": 0.5, "loss": 1.0})
        logger.log(1, {"kl": math.nan, "loss": math.inf})
        logger.log(2, {"kl": 0.25, "loss": 2.0})

    raw = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(raw[1]) == {"step": 1, "kl": None, "loss": None}  # strict JSON: no NaN tokens
    back = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(back[1]["kl"]) and math.isnan(back[1]["loss"])
    assert tensorboard_scalars(tmp_path, "kl") == [(0, 0.5), (2, 0.25)]


@pytest.mark.parametrize(
    ("step", "metrics", "message"),
    [
        (0, {"name": "fast"}, r"metrics\['name'\]: expected a number, got str"),
        (0, {"vector": torch.ones(2)}, r"metrics\['vector'\]: expected a number, got Tensor"),
        (0, {"missing": None}, r"metrics\['missing'\]"),
        (0, {"step": 1.0}, "'step' is reserved"),
        (-1, {"a": 1.0}, "step: expected an integer >= 0, got -1"),
        (1.5, {"a": 1.0}, "step: expected an integer >= 0, got 1.5"),
    ],
)
def test_bad_metrics_are_rejected_naming_the_culprit(tmp_path, step, metrics, message):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(ValueError, match=message):
            logger.log(step, metrics)
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_a_new_logger_appends_to_an_existing_file(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"a": 0.0})
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"a": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]


def test_resume_drops_later_steps_in_jsonl_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(5):
            logger.log(step, {"loss": float(step)})
    # Checkpoint at step 2; steps 3 and 4 are run again and give other values.
    with MetricsLogger(tmp_path, resume_step=2) as logger:
        logger.log(3, {"loss": 30.0})
        logger.log(4, {"loss": 40.0})

    expected = [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == expected
    assert tensorboard_scalars(tmp_path, "loss") == expected


def test_torn_last_line_is_skipped_by_readers_and_dropped_by_writers(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"a": 0.5})
    with path.open("a") as file:
        file.write('{"step": 1, "a": 0.')  # the process died mid-write
    assert read_metrics(path) == [{"step": 0, "a": 0.5}]

    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"a": 1.5})
    assert path.read_text() == '{"step": 0, "a": 0.5}\n{"step": 1, "a": 1.5}\n'


def test_resume_also_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n{"step": 2, "a"')
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=0):
        pass
    assert read_metrics(path) == [{"step": 0, "a": 1}]


def test_malformed_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a valid record"):
        read_metrics(path)


def test_log_after_close_is_an_error(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(ValueError, match="is closed"):
        logger.log(0, {"a": 1.0})


def test_missing_wandb_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'llmrl\[wandb\]'"):
        MetricsLogger(tmp_path, wandb=True)
    assert not (tmp_path / "metrics.jsonl").exists()  # failed before creating anything


def test_wandb_receives_config_and_finite_metrics(tmp_path, monkeypatch):
    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class FakeRun:
        def log(self, metrics, step):
            calls["log"].append((step, metrics))

        def finish(self):
            calls["finish"].append(True)

    def init(**kwargs):
        calls["init"].append(kwargs)
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLogger(
        tmp_path, tensorboard=False, wandb=True, wandb_project="p", config={"seed": 3}
    ) as logger:
        logger.log(4, {"a": 1.0, "b": math.nan})

    assert calls["init"] == [{"project": "p", "mode": "offline", "dir": str(tmp_path), "config": {"seed": 3}}]
    assert calls["log"] == [(4, {"a": 1.0})]
    assert calls["finish"] == [True]


def test_bad_wandb_mode_and_resume_step_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="wandb_mode"):
        MetricsLogger(tmp_path, wandb_mode="sometimes")
    with pytest.raises(ValueError, match="resume_step"):
        MetricsLogger(tmp_path, resume_step=-1)


# ---------------------------------------------------------------- RolloutLog


def test_rollout_log_writes_token_and_dict_rollouts(tmp_path):
    one_turn = TokenRollout(
        env_id="arith",
        problem_id="p1",
        reward=1.0,
        trajectory=[[1], [2]],
        generation_mask=[[False], [True]],
        text=["2+2=", "4"],
    )
    multi_turn = TokenRollout(
        env_id="chat",
        problem_id="p2",
        reward=0.5,
        truncated=True,
        policy_version=3,
        trajectory=[[1, 2], [3], [4], [5]],
        generation_mask=[[False, False], [True], [False], [True]],
        text=["Q:", "a", " retry:", "b"],
    )
    no_text = TokenRollout(
        env_id="arith",
        problem_id="p3",
        status="failed",
        failure_reason="timeout",
        trajectory=[[1], [2]],
        generation_mask=[[False], [True]],
    )
    path = tmp_path / "rollouts.jsonl"
    with RolloutLog(path) as log:
        log.log(7, one_turn, advantage=0.8)
        log.log(7, multi_turn)
        log.log(8, no_text)
        log.log(8, {"prompt": "x", "completion": "y", "reward": 0.0, "note": "custom"})

    records = read_jsonl(path)
    assert records[0] == {
        "step": 7,
        "env_id": "arith",
        "problem_id": "p1",
        "prompt": "2+2=",
        "completion": "4",
        "reward": 1.0,
        "status": "ok",
        "truncated": False,
        "policy_version": 0,
        "newest_version": 0,
        "failure_reason": None,
        "advantage": 0.8,
    }
    assert (records[1]["prompt"], records[1]["completion"]) == ("Q:", "a retry:b")
    assert (records[1]["truncated"], records[1]["policy_version"]) == (True, 3)
    assert (records[2]["prompt"], records[2]["completion"]) == (None, None)
    assert (records[2]["status"], records[2]["failure_reason"]) == ("failed", "timeout")
    assert records[3] == {"step": 8, "prompt": "x", "completion": "y", "reward": 0.0, "note": "custom"}


def test_rollout_log_rejects_clashing_fields_and_resumes(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    rollout = TokenRollout(
        env_id="e", problem_id="p", trajectory=[[1], [2]], generation_mask=[[False], [True]]
    )
    with RolloutLog(path) as log:
        with pytest.raises(ValueError, match=r"\['reward'\] clash"):
            log.log(0, rollout, reward=2.0)
        with pytest.raises(ValueError, match="'step' is reserved"):
            log.log(0, {"step": 1})
        for step in range(4):
            log.log(step, rollout)
    with RolloutLog(path, resume_step=1):
        pass
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]


# ---------------------------------------------------------------- Tracer


def load_trace(path: Path) -> list[dict]:
    trace = json.loads(path.read_text())  # must be strict, complete JSON
    return trace["traceEvents"]


def spans(events: list[dict]) -> dict[str, dict]:
    return {event["name"]: event for event in events if event["ph"] == "X"}


def contains(outer: dict, inner: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def test_nested_spans_instants_and_counters(tmp_path):
    tracer = Tracer(tmp_path / "trace.json")
    with tracer.span("step", step=3):
        with tracer.span("generate", n=8):
            time.sleep(0.01)
        tracer.instant("synced", version=2)
        tracer.counter("queue", {"waiting": 3, "running": 5})
        with pytest.raises(KeyError), tracer.span("reward"):
            raise KeyError("boom")
    tracer.save()

    events = load_trace(tmp_path / "trace.json")
    by_name = spans(events)
    step, generate, reward = by_name["step"], by_name["generate"], by_name["reward"]
    assert step["args"] == {"step": 3} and generate["args"] == {"n": 8}
    assert reward["args"] == {"error": "KeyError"}
    assert contains(step, generate) and contains(step, reward)
    assert generate["dur"] >= 10_000  # microseconds
    assert step["tid"] == generate["tid"] and step["pid"] == generate["pid"]
    assert abs(step["ts"] / 1e6 - time.time()) < 60  # anchored to the wall clock
    instant = next(e for e in events if e["ph"] == "i")
    assert instant["name"] == "synced" and instant["args"] == {"version": 2}
    assert contains(step, {"ts": instant["ts"], "dur": 0})
    counter = next(e for e in events if e["ph"] == "C")
    assert counter["name"] == "queue" and counter["args"] == {"waiting": 3, "running": 5}
    track_names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert track_names[step["tid"]] == threading.current_thread().name


def test_save_can_be_repeated_and_leaves_no_temp_files(tmp_path):
    tracer = Tracer(tmp_path / "trace.json")
    with tracer.span("a"):
        pass
    tracer.save()
    assert list(spans(load_trace(tmp_path / "trace.json"))) == ["a"]
    with tracer.span("b", value=math.nan):
        pass
    tracer.save()
    events = load_trace(tmp_path / "trace.json")
    assert list(spans(events)) == ["a", "b"] and spans(events)["b"]["args"] == {"value": None}
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def test_concurrent_async_tasks_get_their_own_tracks(tmp_path):
    tracer = Tracer(tmp_path / "trace.json")

    async def rollout(name: str) -> None:
        with tracer.span(f"{name}/rollout"):
            with tracer.span(f"{name}/generate"):
                await asyncio.sleep(0.02)
            with tracer.span(f"{name}/reward"):
                await asyncio.sleep(0.01)

    async def main() -> None:
        with tracer.span("collect"):
            await asyncio.gather(rollout("a"), rollout("b"))

    asyncio.run(main())
    tracer.save()
    by_name = spans(load_trace(tmp_path / "trace.json"))
    a, b = by_name["a/rollout"], by_name["b/rollout"]
    assert len({by_name["collect"]["tid"], a["tid"], b["tid"]}) == 3
    for task in ("a", "b"):
        parent = by_name[f"{task}/rollout"]
        for child in ("generate", "reward"):
            assert by_name[f"{task}/{child}"]["tid"] == parent["tid"]
            assert contains(parent, by_name[f"{task}/{child}"])
        assert contains(by_name["collect"], parent)
    assert a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]  # they ran concurrently


def test_tracer_is_thread_safe_while_saving(tmp_path):
    tracer = Tracer(tmp_path / "trace.json")
    threads_count, spans_per_thread = 8, 300
    stop_saving = threading.Event()

    def work() -> None:
        for i in range(spans_per_thread):
            with tracer.span("work", i=i):
                pass

    def save_repeatedly() -> None:
        while not stop_saving.is_set():
            tracer.save()
            load_trace(tmp_path / "trace.json")  # every intermediate file is complete JSON

    saver = threading.Thread(target=save_repeatedly)
    saver.start()
    workers = [threading.Thread(target=work) for _ in range(threads_count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    stop_saving.set()
    saver.join()
    tracer.save()

    events = [e for e in load_trace(tmp_path / "trace.json") if e["ph"] == "X"]
    assert len(events) == threads_count * spans_per_thread
    per_track: dict[int, list[int]] = {}
    for event in events:
        per_track.setdefault(event["tid"], []).append(event["args"]["i"])
    assert sorted(per_track.values()) == [list(range(spans_per_thread))] * threads_count


def test_durations_add_up_per_name_and_reset(tmp_path):
    tracer = Tracer(tmp_path / "trace.json")
    for _ in range(2):
        with tracer.span("train"):
            time.sleep(0.01)
    with tracer.span("sync"):
        pass
    durations = tracer.durations(reset=True)
    assert set(durations) == {"train", "sync"}
    assert 0.02 <= durations["train"] < 1.0 and durations["sync"] < durations["train"]
    assert tracer.durations() == {}


def test_disabled_tracer_keeps_durations_but_writes_nothing(tmp_path):
    tracer = Tracer(tmp_path / "trace.json", enabled=False)
    with tracer.span("generate"):
        time.sleep(0.005)
    tracer.instant("x")
    tracer.counter("y", {"v": 1.0})
    tracer.save()
    assert not (tmp_path / "trace.json").exists()
    assert tracer.durations()["generate"] >= 0.005


def test_event_cap_counts_dropped_events(tmp_path):
    tracer = Tracer(tmp_path / "trace.json", max_events=4)  # process name + thread name + 2 spans
    for _ in range(5):
        with tracer.span("s"):
            pass
    tracer.save()
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert len(spans_list := [e for e in trace["traceEvents"] if e["ph"] == "X"]) == 2, spans_list
    assert trace["otherData"] == {"dropped_events": 3}
    assert tracer.durations()["s"] > 0  # durations are not capped
    with pytest.raises(ValueError, match="max_events"):
        Tracer(tmp_path / "t.json", max_events=0)


def test_trace_span_records_into_the_active_tracer_only(tmp_path):
    tracer = Tracer(tmp_path / "trace.json")
    with trace_span("outside"):
        pass
    with use_tracer(tracer):

        async def task():
            with trace_span("reward", env="a"):
                await asyncio.sleep(0)

        asyncio.run(task())  # tasks inherit the active tracer
    with trace_span("after"):
        pass
    assert set(tracer.durations()) == {"reward"}
