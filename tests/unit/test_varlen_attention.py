"""Attention by sequence boundaries (`llmrl.algorithms.varlen`) against the masked kernels, on a CPU."""

from __future__ import annotations

import pytest
import torch

from llmrl.algorithms import varlen as varlen_kernel
from llmrl.algorithms.logprobs import token_logprobs
from llmrl.algorithms.packing import build_batch, pack
from llmrl.algorithms.varlen import VARLEN, reference_attention, sequence_boundaries
from llmrl.config import ConfigError, load_config
from llmrl.models import load_model


def test_boundaries_start_each_row_and_each_restart_of_the_positions():
    position_ids = torch.tensor(
        [
            [0, 1, 2, 0, 1, 0, 1, 2],  # three sequences
            [0, 1, 2, 3, 4, 5, 6, 7],  # one
            [0, 1, 0, 1, 2, 3, 4, 5],  # two, the second padded on (its positions go on counting)
        ]
    )
    cu, longest = sequence_boundaries(position_ids)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 5, 8, 16, 18, 24]
    assert longest == 8


def test_reference_attention_is_causal_sdpa_within_each_span_with_grouped_heads():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(9, 4, 8, generator=generator)
    key, value = torch.randn(9, 2, 8, generator=generator), torch.randn(9, 2, 8, generator=generator)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = reference_attention(query, key, value, cu, scale=None)
    for start, stop in ((0, 4), (4, 9)):
        for head in range(4):
            q, k, v = query[start:stop, head], key[start:stop, head // 2], value[start:stop, head // 2]
            scores = (q @ k.T) / 8**0.5
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
            torch.testing.assert_close(out[start:stop, head], scores.softmax(-1) @ v)


def counted(function, calls):
    def wrapper(*args):
        calls.append(args)
        return function(*args)

    return wrapper


def test_packed_logprobs_and_gradients_equal_the_masked_kernels(tiny_model_path, monkeypatch):
    """The tiny model on rows packing several sequences: varlen gives sdpa's logprobs and gradients."""
    generator = torch.Generator().manual_seed(1)
    lengths = [7, 12, 5, 9, 3, 14]
    sequences = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]
    batch = build_batch(sequences, pack(lengths, max_tokens=24), pad_token_id=0)
    assert batch.input_ids.shape[0] < len(sequences)  # rows hold several sequences
    results = []
    for implementation in ("sdpa", "varlen"):
        model, _ = load_model("tiny://arithmetic", attn_implementation=implementation)
        assert model.config._attn_implementation == (VARLEN if implementation == "varlen" else "sdpa")
        calls = []
        monkeypatch.setattr(
            varlen_kernel, "sequence_boundaries", counted(varlen_kernel.sequence_boundaries, calls)
        )
        logprobs, _ = token_logprobs(model, batch)
        # varlen finds the boundaries once per forward, not once per layer
        assert len(calls) == (1 if implementation == "varlen" else 0)
        (logprobs * batch.loss_mask).sum().backward()
        results.append((logprobs.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (masked, masked_grads), (varlen, varlen_grads) = results
    torch.testing.assert_close(varlen, masked, atol=1e-5, rtol=1e-5)
    for name, grad in masked_grads.items():
        torch.testing.assert_close(varlen_grads[name], grad, atol=1e-5, rtol=1e-4)


def test_varlen_with_shared_prefixes_is_refused_naming_both_fields():
    with pytest.raises(
        ConfigError, match="model.attn_implementation: varlen .* set training.share_prefixes: false"
    ):
        load_config(overrides=["model.attn_implementation=varlen"])
    config = load_config(overrides=["model.attn_implementation=varlen", "training.share_prefixes=false"])
    assert config.model.attn_implementation == "varlen"
