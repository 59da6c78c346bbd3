"""The colocated vLLM interface's control flow on a stand-in engine: admission, syncs that wait for or
abort running requests, sleep and wake around an update (vLLM's sleep mode is CUDA-only, and no
machine here runs vLLM on a GPU), failures; the config rules of the mode and `llmrl train` running
itself with vLLM's interpreter. tests/integration/test_vllm_colocated.py runs the real engine."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
import types
from types import SimpleNamespace

import pytest
import torch

from llmrl import cli
from llmrl.config import RunConfig, VLLMConfig
from llmrl.inference.vllm.colocated import ColocatedVLLM, sampling_options
from llmrl.types import GenerationArgs, InferenceRequest
from llmrl.weights import FullWeights, WeightSyncError


@pytest.fixture(autouse=True)
def sampling_params_module(monkeypatch):
    """The two names the interface takes from vllm, in a module of their own."""
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **options: SimpleNamespace(**options)
    params = types.ModuleType("vllm.sampling_params")
    params.RequestOutputKind = SimpleNamespace(FINAL_ONLY="final_only")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", params)


class StandInEngine:
    """Answers each request after `max_tokens` steps of 1 ms; records every call in order."""

    def __init__(self, *, fail: str | None = None):
        self.calls: list = []
        self.fail = fail  # a collective_rpc method that raises
        self.running: dict[str, list] = {}
        self.seeds: list[int] = []
        self.model_config = SimpleNamespace(max_model_len=10**6, get_vocab_size=lambda: 1024)
        self.engine_core = SimpleNamespace(shutdown=lambda: self.calls.append("shutdown"))

    def add_request(self, request_id, prompt, params):
        self.calls.append(("add", request_id))
        self.seeds.append(params.seed)
        self.running[request_id] = [params, 0]

    def step(self):
        time.sleep(0.001)
        finished = []
        for request_id, entry in list(self.running.items()):
            entry[1] += 1
            params = entry[0]
            if entry[1] >= params.max_tokens:
                del self.running[request_id]
                self.calls.append(("finished", request_id))
                tokens = list(range(1, params.max_tokens + 1))
                outputs = [
                    SimpleNamespace(
                        index=i,
                        token_ids=tokens,
                        logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in tokens],
                        text="x",
                        finish_reason="length",
                    )
                    for i in range(params.n)
                ]
                finished.append(SimpleNamespace(request_id=request_id, finished=True, outputs=outputs))
        return finished

    def abort_request(self, request_ids, internal=False):
        self.calls.append(("abort", tuple(request_ids)))
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def collective_rpc(self, method, args=()):
        self.calls.append(method)
        if method == self.fail:
            raise ValueError(f"{method} refused")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags or ())))
        return tags is None or "kv_cache" in tags


def colocated(tiny_model, engine=None, pause_mode="wait", **config):
    return ColocatedVLLM(
        engine or StandInEngine(),
        tiny_model[1],
        config=VLLMConfig(mode="colocate", **config),
        seed=0,
        pause_mode=pause_mode,
    )


def request(max_tokens=3, seed=None):
    return InferenceRequest(
        prompt="1 + 2 =", n=2, generation_args=GenerationArgs(max_tokens=max_tokens, seed=seed)
    )


def weights() -> FullWeights:  # a payload is read once
    return FullWeights.of({"w": torch.ones(2)})


def test_responses_carry_tokens_logprobs_and_the_version_they_were_admitted_under(tiny_model):
    with colocated(tiny_model) as engine:
        first = engine.generate(request())
        engine.update_weights(weights(), 7)
        second = engine.generate(request())
    assert [r.token_ids for r in first] == [[1, 2, 3]] * 2 and first[0].logprobs == [-0.5] * 3
    assert {r.policy_version for r in first} == {0} and {r.policy_version for r in second} == {7}
    assert first[0].prompt_token_ids == second[0].prompt_token_ids
    # Text: decoded once at the end, or vLLM's own where stop strings made it detokenise.
    assert first[0].text == tiny_model[1].decode([1, 2, 3], skip_special_tokens=True)
    with colocated(tiny_model) as engine:
        stopped = engine.generate(
            request().model_copy(update={"generation_args": GenerationArgs(stop=("9",))})
        )
    assert stopped[0].text == "x"


def test_a_sync_waits_for_running_requests_then_loads_and_resets_the_prefix_cache(tiny_model):
    with colocated(tiny_model) as engine:
        running = engine.submit(request(max_tokens=200))
        time.sleep(0.02)
        engine.update_weights(weights(), 1)
        calls = engine.engine.calls
        assert {r.policy_version for r in running.result(5)} == {0}
    finished = calls.index(("finished", "llmrl-0"))
    sync = calls.index("start_weight_update")
    assert finished < sync
    assert calls[sync:][:4] == [
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "reset_prefix_cache",
    ]


def test_abort_mode_ends_running_requests_at_a_sync(tiny_model):
    with colocated(tiny_model, pause_mode="abort") as engine:
        running = engine.submit(request(max_tokens=100_000))
        time.sleep(0.02)
        engine.update_weights(weights(), 1)
        responses = running.result(5)
    assert {r.finish_reason for r in responses} == {"abort"} and len(responses) == 2
    assert ("abort", ("llmrl-0",)) in engine.engine.calls


def test_sleep_during_the_update_and_wake_for_the_sync(tiny_model):
    with colocated(tiny_model, sleep_level=2) as engine:
        engine.generate(request())
        engine.transport.before_update()
        assert engine.sleeping and engine.engine.calls[-1] == ("sleep", 2)
        mark = len(engine.engine.calls)
        engine.update_weights(weights(), 1)
        assert engine.engine.calls[mark:] == [
            ("wake_up", ("weights",)),
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "reset_prefix_cache",
            ("wake_up", ("kv_cache",)),
        ]
        assert not engine.sleeping and engine.policy_version == 1


def test_a_request_to_a_sleeping_engine_wakes_it_first(tiny_model):
    with colocated(tiny_model, sleep_level=1) as engine:
        engine.transport.before_update()
        engine.generate(request())
        calls = engine.engine.calls
    assert calls.index(("wake_up", ())) < calls.index(("add", "llmrl-0"))


def test_without_a_sleep_level_the_engine_never_sleeps(tiny_model):
    with colocated(tiny_model) as engine:
        engine.transport.before_update()
        engine.update_weights(weights(), 1)
    assert not [c for c in engine.engine.calls if isinstance(c, tuple) and c[0] in ("sleep", "wake_up")]


@pytest.mark.parametrize("stage", ["update_weights", "finish_weight_update"])
def test_a_failed_sync_ends_vllms_update_session_and_keeps_the_version(tiny_model, stage):
    with colocated(tiny_model, engine=StandInEngine(fail=stage)) as engine:
        with pytest.raises(WeightSyncError, match=f"{stage} refused"):
            engine.update_weights(weights(), 3)
        assert engine.engine.calls[-1] == "llmrl_abandon_weight_update"
        assert engine.policy_version == 0
        assert engine.generate(request())[0].policy_version == 0  # it goes on serving


def test_requests_that_do_not_fit_fail_alone(tiny_model):
    with colocated(tiny_model) as engine:
        with pytest.raises(ValueError, match="max_tokens: 2000000"):
            engine.generate(request(max_tokens=2 * 10**6))
        assert len(engine.generate(request())) == 2


def test_seedless_requests_get_seeds_from_the_run_seed(tiny_model):
    seeds = []
    for _ in range(2):
        with colocated(tiny_model) as engine:
            engine.generate(request())
            engine.generate(request())
        seeds.append(engine.engine.seeds)
    assert seeds[0] == seeds[1] and len(set(seeds[0])) == 2
    options = sampling_options(request(seed=11).model_copy(update={"n": 3}))
    assert options["seed"] == 11 and options["n"] == 3 and options["top_k"] == -1 and options["logprobs"] == 0


def test_closing_fails_what_is_queued_and_refuses_more(tiny_model):
    engine = colocated(tiny_model)
    engine.close()
    assert engine.engine.calls[-1] == "shutdown"
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(request())


def test_requests_from_many_threads_all_get_answers(tiny_model):
    with colocated(tiny_model) as engine:
        answers: list = []
        threads = [
            threading.Thread(target=lambda: answers.append(engine.generate(request()))) for _ in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert len(answers) == 8


# -- the mode's config rules and the interpreter switch -------------------------------------------


ENVIRONMENTS = {"environments": [{"agent_type": "arithmetic"}]}


def run_config(**inference) -> dict:
    return ENVIRONMENTS | {"inference": {"type": "vllm", "vllm": {"mode": "colocate"}} | inference}


@pytest.mark.parametrize(
    "data, message",
    [
        (run_config(base_url="http://127.0.0.1:8000"), "inference.base_url"),
        (
            run_config(vllm={"mode": "colocate", "sleep_level": 1}) | {"training": {"generation_lag": 1}},
            "sleep_level",
        ),
        (
            ENVIRONMENTS | {"inference": {"type": "vllm", "vllm": {"sleep_level": 1}}},
            "only a colocated engine sleeps",
        ),
    ],
)
def test_config_rules_of_the_colocated_mode(data, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate(data)


def test_llmrl_train_runs_itself_with_vllms_interpreter(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a)
    )
    monkeypatch.setattr(
        "llmrl.inference.vllm.find_vllm_python", lambda configured: "/opt/vllm-env/bin/python"
    )
    # The command marks the environment it runs again in; set here first, so the mark goes when the test
    # does (a leftover mark would refuse the switch in later tests' `llmrl train`).
    monkeypatch.setenv(cli._REEXEC_MARK, "")
    monkeypatch.delenv(cli._REEXEC_MARK)
    executed = []

    def execv(path, argv):
        executed.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", execv)
    argv = ["train", "examples/arithmetic_vllm_colocate.yaml", "--set", f"run_dir={tmp_path}"]
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert executed == [["/opt/vllm-env/bin/python", "-m", "llmrl", *argv]]
    assert os.environ[cli._REEXEC_MARK] == "1"

    # Run again there and still without vllm: one line, no loop.
    assert cli.main(argv) == cli.EXIT_USAGE
