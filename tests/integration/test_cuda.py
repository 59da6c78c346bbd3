"""The trainer on a GPU: mixed precision, activation checkpointing, the engine, the memory plan.

Marked `cuda`: skipped where torch sees no GPU (tests/conftest.py). Run on a GPU machine with
``python -m pytest -m cuda`` (or ``bash scripts/gpu_checks.sh``, which also runs bench/gpu.py);
docs/benchmarks.md records the card, the versions and the results.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from llmrl.config import load_config
from llmrl.telemetry import read_metrics
from llmrl.trainer import Trainer

pytestmark = pytest.mark.cuda

QUICK = [
    "training.steps=3",
    "training.prompts_per_step=4",
    "training.group_size=4",
    "evaluation.at_start=false",
    "evaluation.every=0",
    "evaluation.num_prompts=8",
    "logging.progress=off",
    "logging.tensorboard=false",
    "training.device=cuda",
]


def train(run_dir, *overrides: str) -> dict:
    config = load_config(None, [f"run_dir={run_dir}", *QUICK, *overrides])
    return Trainer(config, progress_stream=open(os.devnull, "w")).run()  # noqa: SIM115


@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "checkpointed"])
def test_bfloat16_compute_over_float32_masters_on_a_gpu(tmp_path, tiny_model_path, checkpointing):
    run_dir = tmp_path / "run"
    train(run_dir, "model.dtype=bfloat16", f"training.activation_checkpointing={str(checkpointing).lower()}")
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [row for row in rows if "train/loss" in row]
    assert len(steps) == 3 and all(torch.isfinite(torch.tensor(row["train/loss"])) for row in steps)
    # CUDA's allocator peak, under the plan (which has no process term on a GPU)
    assert all(0 < row["memory/peak_gb"] <= row["memory/plan_gb"] for row in steps)
    trained = [
        row for row in steps if "train/mismatch_kl" in row
    ]  # a step whose groups all tie trains nothing
    assert (
        trained and max(row["train/mismatch_kl"] for row in trained) < 1e-2
    )  # engine and trainer both in bfloat16
    folder = run_dir / "checkpoints" / "step_000003"
    assert {t.dtype for t in load_file(folder / "model" / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((folder / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(folder / "master.safetensors").values()} == {torch.float32}


def test_float32_on_a_gpu_matches_its_own_rerun(tmp_path, tiny_model_path):
    """Same config, same numbers, on CUDA too (deterministic kernels, TF32 off)."""
    first = train(tmp_path / "a", "training.tf32=false")
    second = train(tmp_path / "b", "training.tf32=false")
    assert first["eval_end"] == second["eval_end"]
    assert [r.get("train/loss") for r in read_metrics(tmp_path / "a" / "metrics.jsonl")] == [
        r.get("train/loss") for r in read_metrics(tmp_path / "b" / "metrics.jsonl")
    ]


def test_varlen_attention_on_a_gpu_gives_the_masked_kernels_numbers(tiny_model_path):
    """torch's variable-length flash attention over packed rows: sdpa's logprobs and gradients, in
    bfloat16 (flash attention's dtype), so to bfloat16's precision."""
    from llmrl.algorithms.logprobs import token_logprobs
    from llmrl.algorithms.packing import build_batch, pack
    from llmrl.models import load_model

    generator = torch.Generator().manual_seed(1)
    lengths = [7, 12, 5, 9, 3, 14]
    sequences = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]
    batch = build_batch(sequences, pack(lengths, max_tokens=24), pad_token_id=0).to("cuda")
    results = []
    for implementation in ("sdpa", "varlen"):
        model, _ = load_model(
            "tiny://arithmetic", dtype="bfloat16", device="cuda", attn_implementation=implementation
        )
        logprobs, _ = token_logprobs(model, batch)
        (logprobs * batch.loss_mask).sum().backward()
        results.append((logprobs.detach().float(), model.lm_head.weight.grad.float()))
    (masked, masked_grad), (varlen, varlen_grad) = results
    torch.testing.assert_close(varlen, masked, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(varlen_grad, masked_grad, atol=5e-2, rtol=5e-2)


def test_decode_steps_replayed_as_cuda_graphs_give_the_eager_numbers(tiny_model_path):
    """`inference.cuda_graphs: on`: graphs are captured, replayed with the eager decoder's tokens and
    logprobs (float32, TF32 off: equal up to the padded buckets' rounding), and serve the next batch
    and the weights loaded after their capture without being captured again."""
    from llmrl.inference.engine import LocalEngine
    from llmrl.models import load_model
    from llmrl.models.shape import tied_duplicates
    from llmrl.types import GenerationArgs, InferenceRequest

    torch.backends.cuda.matmul.allow_tf32 = False
    requests = [
        InferenceRequest(
            prompt="12 + 35 =", n=5, generation_args=GenerationArgs(max_tokens=40, temperature=0.0)
        ),
        InferenceRequest(
            prompt="7 * 8 = 56. 3 + 4 =", n=3, generation_args=GenerationArgs(max_tokens=25, seed=1)
        ),
    ]
    generator = torch.Generator().manual_seed(2)
    results = {}
    for graphs in ("on", "off"):
        model, tokenizer = load_model("tiny://arithmetic", dtype="float32", device="cuda")
        noise = {
            name: 0.02 * torch.randn(value.shape, generator=generator.manual_seed(2)).to("cuda")
            for name, value in model.state_dict().items()
        }
        engine = LocalEngine(model, tokenizer, seed=0, cuda_graphs=graphs, eos_token_ids=())
        try:
            before = [engine.generate(r) for r in requests]
            captured = engine._decoder.steps.captures if graphs == "on" else 0
            tied = tied_duplicates(model)
            update = {k: v + noise[k] for k, v in model.state_dict().items() if k not in tied}
            engine.update_weights(update, version=1)
            after = [engine.generate(r) for r in requests]
            if graphs == "on":  # the same buckets and widths again: the first batch's graphs serve
                assert engine._decoder.steps.captures == captured > 0
            results[graphs] = before + after
        finally:
            engine.close()
    for on, off in zip(results["on"], results["off"], strict=True):
        for graphed, eager in zip(on, off, strict=True):
            assert graphed.token_ids == eager.token_ids
            torch.testing.assert_close(
                torch.tensor(graphed.logprobs), torch.tensor(eager.logprobs), atol=1e-4, rtol=0
            )


def test_packed_prefill_on_a_gpu_gives_the_padded_prefills_numbers(tiny_model_path):
    """The graphed decoder's prefill in bfloat16 attends prompts end to end through flash attention's
    variable-length kernel: the padded, masked prefill's logits and cache, to bfloat16's precision."""
    from llmrl.inference.static_decode import PagedLlamaDecoder
    from llmrl.models import load_model

    model, _ = load_model("tiny://arithmetic", dtype="bfloat16", device="cuda")
    packed = PagedLlamaDecoder(model, max_rows=8)
    padded = PagedLlamaDecoder(model, max_rows=8, packed_prefill=False)
    assert packed.packed_prefill
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (5, 40, 17, 1)]
    with torch.inference_mode():
        logits = packed.prefill(prompts, [2, 3, 1, 1]), padded.prefill(prompts, [2, 3, 1, 1])
    torch.testing.assert_close(logits[0].float(), logits[1].float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(packed.cache.pool_k.float(), padded.cache.pool_k.float(), atol=5e-2, rtol=5e-2)
