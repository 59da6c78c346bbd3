"""`llmrl serve-tinker` as its own process, driven by the official tinker SDK over real HTTP."""

from __future__ import annotations

import pytest
import tinker
from servers import serving
from tinker import types

pytestmark = pytest.mark.slow
BASE = "tiny://arithmetic"


def sft_datum(tokenizer) -> types.Datum:
    tokens = tokenizer("12+34=46", add_special_tokens=False)["input_ids"]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def sft_steps(client, datum, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        backward = client.forward_backward([datum], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
        losses.append(backward.result(timeout=120).metrics["loss:sum"])
    return losses


def test_sdk_trains_samples_and_resumes_in_a_new_server_process(tmp_path, monkeypatch, tiny_model):
    """Train and sample against the command; a state saved there, loaded by a second server process over
    the same storage folder, continues with the same numbers as the first server did."""
    _, tokenizer = tiny_model
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    datum = sft_datum(tokenizer)
    command = ("llmrl", "serve-tinker", "--model", BASE, "--storage", str(tmp_path / "storage"))
    with serving(*command, log_path=tmp_path / "first.log") as base_url:
        service = tinker.ServiceClient(base_url=base_url, api_key="tml-local")
        client = service.create_lora_training_client(base_model=BASE, rank=8, seed=0).result(timeout=120)
        losses = sft_steps(client, datum, 3)
        assert losses[-1] < losses[0], losses
        path = client.save_state("after-3").result(timeout=120).path
        continued = sft_steps(client, datum, 2)
        sampler = client.save_weights_and_get_sampling_client().result(timeout=120)
        prompt = types.ModelInput.from_ints(datum.model_input.to_ints()[:-1])
        result = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=4, seed=1)).result(timeout=120)
        assert len(result.sequences) == 3 and all(s.tokens for s in result.sequences)
        service.close("success").result(timeout=60)

    with serving(*command, log_path=tmp_path / "second.log") as base_url:
        service = tinker.ServiceClient(base_url=base_url, api_key="tml-local")
        resumed = service.create_training_client_from_state_with_optimizer(path).result(timeout=120)
        assert sft_steps(resumed, datum, 2) == continued
        service.close("success").result(timeout=60)
