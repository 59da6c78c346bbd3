"""Chunked selective log-softmax against torch.log_softmax(...).gather, and its memory bound."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from llmrl.algorithms.logprobs import logprobs_from_hidden, selective_log_softmax, token_logprobs
from llmrl.algorithms.packing import build_batch


def naive(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Full log-softmax over the vocabulary, then gather; entropy as -sum p log p."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, targets[..., None]).squeeze(-1), entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_selective_log_softmax_matches_naive(temperature, chunk_size):
    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(3, 11, 257, generator=generator)
    targets = torch.randint(0, 257, (3, 11), generator=generator)
    logprobs, entropies = selective_log_softmax(
        logits, targets, temperature, with_entropy=True, chunk_size=chunk_size
    )
    expected_logprobs, expected_entropies = naive(logits, targets, temperature)
    assert logprobs.shape == targets.shape and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropies, expected_entropies, rtol=0, atol=1e-6)
    assert selective_log_softmax(logits, targets, temperature, chunk_size=chunk_size)[1] is None


def test_hand_derived_case():
    # logits [0, log 3, -inf] at temperature 1: p = [1/4, 3/4, 0]; log p(1) = log 0.75,
    # entropy = -(0.25 log 0.25 + 0.75 log 0.75) = 0.5623 (the banned token adds 0, not NaN).
    # At temperature 0.5 the logits double: [0, log 9] -> p = [0.1, 0.9].
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf]])
    logprob, entropy = selective_log_softmax(logits, torch.tensor([1]), with_entropy=True)
    assert logprob.item() == pytest.approx(math.log(0.75))
    assert entropy.item() == pytest.approx(0.5623351446188083)
    logprob, _ = selective_log_softmax(logits, torch.tensor([0]), temperature=0.5)
    assert logprob.item() == pytest.approx(math.log(0.1), abs=1e-6)


def test_bfloat16_logits_are_computed_in_float32():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=generator).bfloat16()
    targets = torch.randint(0, 300, (5,), generator=generator)
    logprobs, _ = selective_log_softmax(logits, targets, 0.9)
    torch.testing.assert_close(logprobs, naive(logits, targets, 0.9)[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [5, 26])  # several checkpointed chunks; one chunk, not checkpointed
def test_logprobs_from_hidden_values_and_gradients(chunk_size):
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 13, 16, generator=generator, requires_grad=True)
    weight = (0.25 * torch.randn(97, 16, generator=generator)).requires_grad_()  # logits of order 1
    bias = torch.randn(97, generator=generator, requires_grad=True)
    targets = torch.randint(0, 97, (2, 13), generator=generator)
    upstream = torch.randn(2, 13, generator=generator), torch.randn(2, 13, generator=generator)

    logprobs, entropies = logprobs_from_hidden(
        hidden, weight, targets, 0.8, lm_head_bias=bias, with_entropy=True, chunk_size=chunk_size
    )
    got = torch.autograd.grad(
        (logprobs * upstream[0] + entropies * upstream[1]).sum(), [hidden, weight, bias]
    )
    expected_logprobs, expected_entropies = naive(hidden @ weight.T + bias, targets, 0.8)
    expected = torch.autograd.grad(
        (expected_logprobs * upstream[0] + expected_entropies * upstream[1]).sum(), [hidden, weight, bias]
    )
    # The chunked matmul may round differently from the full one, hence the small rtol as well.
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropies, expected_entropies, rtol=1e-6, atol=1e-6)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation creates (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def test_memory_never_holds_tokens_times_vocab():
    # 256 tokens x 512 vocab; chunks of 32 tokens. No tensor of the chunked path (forward or
    # backward) may be as large as tokens x vocab; the naive path creates several.
    tokens, vocab, width, chunk = 256, 512, 16, 32
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    with LargestTensor() as chunked:
        logprobs, entropies = logprobs_from_hidden(
            hidden, weight, targets, with_entropy=True, chunk_size=chunk
        )
        (logprobs + entropies).sum().backward()
    assert chunked.largest <= max(chunk * vocab, vocab * width, tokens * width)
    with LargestTensor() as full:
        logprobs, entropies = naive(hidden @ weight.T, targets, 1.0)
        (logprobs + entropies).sum().backward()
    assert full.largest >= tokens * vocab  # the measure can tell the two apart


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=89,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval()


def test_token_logprobs_fills_only_the_loss_mask():
    model = tiny_qwen2()
    sequence = [5, 17, 3, 60, 2, 44]
    batch = build_batch([sequence], [[0]], [[False, False, True, True, False, True]])
    with torch.no_grad():
        logprobs, entropies = token_logprobs(model, batch, temperature=0.9, with_entropy=True)
        ids = torch.tensor([sequence])
        expected_logprobs, expected_entropies = naive(model(ids).logits[0, :-1], ids[0, 1:], 0.9)
    mask = batch.loss_mask[0]
    # Token t is predicted from position t - 1: logprobs[t] == naive[t - 1] where the mask is True.
    torch.testing.assert_close(logprobs[0, mask], expected_logprobs[mask[1:]], rtol=0, atol=1e-6)
    torch.testing.assert_close(entropies[0, mask], expected_entropies[mask[1:]], rtol=0, atol=1e-6)
    assert (logprobs[0, ~mask] == 0).all() and (entropies[0, ~mask] == 0).all()


@pytest.mark.parametrize(
    ("config_class", "transform"),
    [
        ("Gemma2Config", {"final_logit_softcapping": 2.0}),
        ("CohereConfig", {"logit_scale": 0.3}),
        ("GraniteConfig", {"logits_scaling": 4.0}),
    ],
)
def test_token_logprobs_transform_logits_as_the_model_does(config_class, transform):
    """Soft-capping, scaling and division of the logits: the model's own forward is the reference
    (a large ``initializer_range`` makes the logits large enough for each transform to matter)."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        initializer_range=0.5,
        **transform,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    sequence = [3, 14, 15, 9, 26, 5, 35]
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, :-1].float()
        expected = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]
        logprobs, _ = token_logprobs(model, build_batch([sequence], [[0]]), temperature=0.7)
        untransformed = torch.log_softmax(
            model.lm_head(model.model(torch.tensor([sequence])).last_hidden_state)[0, :-1] / 0.7, -1
        ).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]
    torch.testing.assert_close(logprobs[0, 1:], expected, rtol=0, atol=1e-5)
    assert (untransformed - expected).abs().max() > 0.1  # the transform matters here


def test_token_logprobs_needs_a_causal_lm():
    with pytest.raises(ValueError, match="causal LM"):
        token_logprobs(tiny_qwen2().model, build_batch([[1, 2, 3]], [[0]]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"temperature": 0.0}, "temperature"), ({"chunk_size": 0}, "chunk_size")],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        selective_log_softmax(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), **kwargs)
    with pytest.raises(ValueError, match="targets"):
        selective_log_softmax(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="lm_head_weight"):
        logprobs_from_hidden(torch.zeros(2, 4), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long))
