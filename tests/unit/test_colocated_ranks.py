"""Colocated vLLM under torchrun (`llmrl.inference.vllm.ranks`) on stand-in engines: rank 0's interface
spreads requests over its own engine and another process's service, seeds them itself, and passes
back refusals and a lost process; closing ends the service. The two sides talk over a pipe here (a
socket between processes in a run); tests/integration/test_vllm_colocated.py trains under torchrun
with real engines."""

from __future__ import annotations

from concurrent.futures import wait
from multiprocessing import Pipe

import pytest

from llmrl.inference.vllm.ranks import ColocatedRanks, RankService
from tests.unit.test_colocated_vllm import (  # noqa: F401 (the fixture stands in for vllm's names)
    colocated,
    request,
    sampling_params_module,
)


def two_processes(tiny_model, seed=0):
    """Rank 0's interface over its own stand-in engine and process 1's service."""
    rank0_end, rank1_end = Pipe()
    service = RankService(colocated(tiny_model), rank1_end, rank=1)
    return ColocatedRanks(colocated(tiny_model), [rank0_end], seed=seed), service


def test_requests_spread_over_both_processes_engines_and_all_get_answers(tiny_model):
    ranks, service = two_processes(tiny_model)
    futures = [ranks.submit(request(max_tokens=5)) for _ in range(12)]
    wait(futures, timeout=30)
    assert all(len(future.result()) == 2 for future in futures)
    assert ranks.requests_served == [6, 6]  # the fewest samples outstanding first, ties to rank 0
    served_by_1 = [call for call in service.local.engine.calls if call[0] == "add"]
    assert len(served_by_1) == 6
    assert ranks.weight_transport("weights") is ranks.local.transport
    assert ranks.health().servers == ("vLLM in process 0", "vLLM in process 1")
    ranks.close()
    assert service.peer.ended.wait(10)  # rank 0's close ends the service's reading
    service.close()
    assert ranks.local.engine.calls[-1] == service.local.engine.calls[-1] == "shutdown"


def test_rank_0_seeds_every_request_so_that_the_run_seed_decides_them_all(tiny_model):
    runs = []
    for _ in range(2):
        ranks, service = two_processes(tiny_model, seed=3)
        wait([ranks.submit(request()) for _ in range(6)], timeout=30)
        seeds = ranks.local.engine.seeds + service.local.engine.seeds
        ranks.close()
        service.close()
        runs.append(sorted(seeds))
    assert runs[0] == runs[1] and len(set(runs[0])) == 6  # no two engines draw the same seeds


def test_a_refusal_on_another_process_fails_its_request_alone(tiny_model):
    ranks, service = two_processes(tiny_model)
    busy = ranks.submit(request(max_tokens=50))  # rank 0's engine; the next goes to process 1
    refused = ranks.submit(request(max_tokens=2 * 10**6))
    with pytest.raises(ValueError, match="max_tokens: 2000000"):
        refused.result(timeout=10)
    assert ranks.requests_served == [1, 1]
    assert len(busy.result(timeout=10)) == 2
    assert len(ranks.generate(request())) == 2
    ranks.close()
    service.close()


def test_a_lost_process_fails_the_requests_it_was_serving(tiny_model):
    ranks, service = two_processes(tiny_model)
    ranks.submit(request(max_tokens=200))  # keeps rank 0's engine the busier one
    lost = ranks.submit(request(max_tokens=5_000))
    service.close()  # its process ends: the socket closes under the request
    with pytest.raises(RuntimeError, match="lost the colocated vLLM engine of process 1"):
        lost.result(timeout=10)
    ranks.close()
