"""`llmrl serve-tinker` as its own process, driven by the official tinker SDK over real HTTP."""

from __future__ import annotations

import pytest
import tinker
from servers import serving
from tinker import types

pytestmark = pytest.mark.slow
BASE = "tiny://arithmetic"


def test_sdk_trains_and_samples_against_the_command(tmp_path, monkeypatch, tiny_model):
    _, tokenizer = tiny_model
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with serving("llmrl", "serve-tinker", "--model", BASE, log_path=tmp_path / "server.log") as base_url:
        service = tinker.ServiceClient(base_url=base_url, api_key="tml-local")
        client = service.create_lora_training_client(base_model=BASE, rank=8, seed=0).result(timeout=120)
        tokens = tokenizer("12+34=46", add_special_tokens=False)["input_ids"]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        losses = []
        for _ in range(5):
            backward = client.forward_backward([datum], "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
            losses.append(backward.result(timeout=120).metrics["loss:sum"])
        assert losses[-1] < losses[0], losses
        sampler = client.save_weights_and_get_sampling_client().result(timeout=120)
        prompt = types.ModelInput.from_ints(tokens[:-2])
        result = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=4, seed=1)).result(timeout=120)
        assert len(result.sequences) == 3 and all(s.tokens for s in result.sequences)
        service.close("success").result(timeout=60)
