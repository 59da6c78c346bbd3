"""An RL loop written against the official `tinker` SDK alone learns the tiny model's task through
`llmrl serve-tinker` run as its own process: GRPO groups sampled from the served adapter, rewarded by
llmrl's arithmetic reward, trained with ``importance_sampling`` (the loop: `tinker_loops.py`)."""

from __future__ import annotations

import pytest
import tinker
from servers import serving
from tinker_loops import BASE, LoopSettings, grpo_loop

pytestmark = [pytest.mark.slow, pytest.mark.cross_cpu]

# 40 steps of 16 problems x 8 samples at a constant 1e-3: about 60 s on 2 shared CPU cores. Vetted with
# seeds 0 and 1, and at 2e-3 with both: held-out pass@1 went from 0.30 to 0.42-0.44 every time. The LoRA
# demo's 3e-3 needs its 32 problems a step and its cosine: at a constant 3e-3 on 16 problems both this
# loop and `llmrl train` lose ground over the first steps before they gain.
SETTINGS = LoopSettings(steps=40, problems_per_step=16, group_size=8, learning_rate=1e-3, eval_every=40)
GAIN = 0.07
"""Least rise of held-out pass@1 asserted: about half of what the vetted runs gained."""
MISMATCH = 1e-3
"""Largest gap allowed between the trained model's logprobs and the sampler's on the sampled tokens
(float32 on CPU, the sampler's adapter merged into its weights, the trainer's not)."""


def test_a_grpo_loop_through_the_sdk_raises_held_out_pass_at_1(tmp_path, monkeypatch, tiny_model):
    _, tokenizer = tiny_model
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    command = ("serve-tinker", "--model", BASE, "--storage", str(tmp_path / "storage"))
    with serving("llmrl", *command, log_path=tmp_path / "server.log") as base_url:
        service = tinker.ServiceClient(base_url=base_url, api_key="tml-local")
        record = grpo_loop(service, tokenizer, SETTINGS)
        service.close("success").result(timeout=60)

    before, after = record.held_out[0], record.held_out[SETTINGS.steps]
    assert after >= before + GAIN, record.held_out
    # Each step's sampler serves the adapter as the last optim_step left it: the data are on-policy.
    assert max(record.logprob_mismatch) < MISMATCH, record.logprob_mismatch
