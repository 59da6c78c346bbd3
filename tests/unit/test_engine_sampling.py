"""The engine's batched sampler against a naive per-row reference (Hugging Face warper semantics)."""

from __future__ import annotations

import math

import pytest
import torch

from llmrl.inference import sampling
from llmrl.inference.sampling import MAX_UNIFORM, row_sampling, sample_tokens
from llmrl.types import GenerationArgs


def reference_distribution(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """Temperature, min-p, then top-k, then top-p on the renormalised top-k distribution, one row, by hand.

    Min-p drops tokens less likely than min_p times the most likely one. Top-p as Hugging Face's
    TopPLogitsWarper: sort ascending and drop the tokens whose cumulative probability is
    <= 1 - top_p, always keeping the most likely token.
    """
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if min_p:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    if top_k:
        kth = probs.sort(descending=True).values[top_k - 1]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum()
    if top_p < 1.0:
        ascending, order = probs.sort()
        removed = ascending.cumsum(0) <= 1 - top_p
        removed[-1] = False
        probs = probs.clone()
        probs[order[removed]] = 0.0
    return probs / probs.sum()


# Hand-checked case: logits log([0.5, 0.3, 0.15, 0.05]) at T=1 with top_p=0.7 keeps {0.5, 0.3}
# (0.5 < 0.7, then 0.5 + 0.3 >= 0.7) and renormalises to [0.625, 0.375, 0, 0].
def test_hand_derived_top_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    expected = torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(reference_distribution(logits, 1.0, 0, 0.7), expected)
    assert torch.allclose(_empirical(logits, GenerationArgs(top_p=0.7)), expected, atol=1e-3)


def _empirical(logits: torch.Tensor, args: GenerationArgs, draws: int = 20_000) -> torch.Tensor:
    """Frequencies of each token over uniforms spaced evenly on [0, 1): exact up to 1/draws."""
    rows = row_sampling([args] * draws, logits.shape[-1], "cpu")
    uniforms = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    tokens, _ = sample_tokens(logits.expand(draws, -1), rows, uniforms.float())
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / draws


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 0, 1.0, 0.0),
        (1.3, 3, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (0.8, 5, 0.6, 0.0),
        (1.0, 1, 1.0, 0.0),
        (2.0, 4, 0.95, 0.0),
        (1.0, 0, 1.0, 0.1),
        (1.2, 6, 0.9, 0.05),
    ],
)
def test_sampled_frequencies_match_reference(temperature, top_k, top_p, min_p):
    logits = torch.randn(11, generator=torch.Generator().manual_seed(3)) * 2
    args = GenerationArgs(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = reference_distribution(logits, temperature, top_k, top_p, min_p)
    assert (_empirical(logits, args) - expected).abs().max().item() < 2e-3


def test_logprobs_describe_the_distribution_sampled_from_and_greedy_reports_temperature_one():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=generator) * 3
    args = [
        GenerationArgs(temperature=0.0, top_k=3),
        GenerationArgs(temperature=0.7, top_k=3),
        GenerationArgs(temperature=1.5, top_p=0.5),
        GenerationArgs(temperature=1.0),
        GenerationArgs(temperature=0.9, min_p=0.2),
    ]
    rows = row_sampling(args, 50, "cpu")
    tokens, logprobs = sample_tokens(logits.double(), rows, torch.rand(5, generator=generator))
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert tokens[0] == logits[0].argmax()
    assert abs(logprobs[0].item() - torch.log_softmax(logits[0], dim=-1)[tokens[0]].item()) < 1e-6
    for row, a in enumerate(args[1:], start=1):
        expected = reference_distribution(logits[row], a.temperature, a.top_k, a.top_p, a.min_p)[
            tokens[row]
        ].log()
        assert abs(logprobs[row].item() - expected.item()) < 1e-6
    assert tokens[1] in logits[1].topk(3).indices


def test_an_unlikely_drawn_token_reports_its_log_softmax():
    # The logprob is log(softmax[token]); for a token of probability ~1e-6 it must still match
    # log_softmax (no precision lost to taking the log of a small float32).
    logits = torch.tensor([[10.0, -4.0, 0.0]])
    probs = torch.softmax(logits, dim=-1)
    cdf = probs.cumsum(dim=-1)[0]
    u = ((cdf[0] + probs[0, 1] / 2) / cdf[-1]).reshape(1)  # inside token 1's interval
    token, logprob = sample_tokens(logits, row_sampling([GenerationArgs()], 3, "cpu"), u)
    assert token.item() == 1 and probs[0, 1] < 1e-6
    assert abs(logprob.item() - torch.log_softmax(logits.double(), dim=-1)[0, 1].item()) < 1e-5


def test_a_row_draws_the_same_token_whatever_its_neighbours_do():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 40, generator=generator)
    plain = GenerationArgs(temperature=0.9)
    for u in torch.linspace(0.001, 0.999, 37):
        (alone,), _ = sample_tokens(logits, row_sampling([plain], 40, "cpu"), u[None])
        neighbours = [
            GenerationArgs(top_k=2),
            plain,
            GenerationArgs(temperature=0.0),
            GenerationArgs(top_p=0.3),
        ]
        batch_logits = torch.cat(
            [torch.randn(1, 40, generator=generator), logits, torch.randn(2, 40, generator=generator)]
        )  # row 1 is ours
        rows = row_sampling(neighbours, 40, "cpu")
        tokens, _ = sample_tokens(
            batch_logits, rows, torch.stack([torch.rand(()), u, torch.rand(()), torch.rand(())])
        )
        assert tokens[1] == alone


@pytest.mark.parametrize("spread", [8.0, 0.5])  # peaked: decided in the partial sort; flat: falls back
def test_partial_sort_filters_like_a_full_sort(spread, monkeypatch):
    vocab = 4 * sampling.PARTIAL_SORT
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5)) * spread
    args = [
        GenerationArgs(top_p=0.9),
        GenerationArgs(top_k=10),
        GenerationArgs(),
        GenerationArgs(top_k=100, top_p=0.5),
        GenerationArgs(top_k=sampling.PARTIAL_SORT, top_p=0.99),
        GenerationArgs(temperature=0.0),
    ]
    rows = row_sampling(args, vocab, "cpu")
    probs = torch.softmax(logits, dim=-1)
    partial = sampling._top_k_top_p(probs, rows)
    monkeypatch.setattr(sampling, "PARTIAL_SORT", vocab)  # sort the whole vocabulary
    full = sampling._top_k_top_p(probs, rows)
    assert torch.equal(partial > 0, full > 0)
    assert (full[1] > 0).sum() == 10 and (full[2] > 0).all()


def test_uniform_rounding_to_one_never_draws_a_filtered_token():
    logits = torch.tensor([[5.0, 4.0, -math.inf, 3.0, -40.0, -50.0]])
    for args in (GenerationArgs(top_k=2), GenerationArgs(), GenerationArgs(top_p=0.5)):
        rows = row_sampling([args], 6, "cpu")
        for u in (MAX_UNIFORM, 1.0 - 1e-7, 0.9999):
            token, _ = sample_tokens(logits, rows, torch.tensor([u]))
            allowed = {0, 1} if args.top_k == 2 else ({0} if args.top_p == 0.5 else {0, 1, 3, 4, 5})
            assert token.item() in allowed


def test_row_sampling_turns_filters_off_at_their_neutral_values():
    rows = row_sampling(
        [GenerationArgs(top_k=0, top_p=1.0), GenerationArgs(top_k=500, temperature=0.0)], 100, "cpu"
    )
    assert not rows.any_filter and rows.any_greedy and not rows.all_greedy and rows.unit_temperature
    assert not row_sampling([GenerationArgs(temperature=0.5)], 100, "cpu").unit_temperature
    # Tensors that sampling will not read are not built.
    assert rows.top_k is None and rows.top_p is None and rows.temperature is None
    assert rows.greedy.tolist() == [False, True]
    filtered = row_sampling(
        [GenerationArgs(top_k=0, top_p=1.0), GenerationArgs(top_k=5, temperature=0.5)], 100, "cpu"
    )
    assert filtered.top_k.tolist() == [[100], [5]] and math.isinf(filtered.top_p[0, 0].item())
    assert filtered.temperature.tolist() == [[1.0], [0.5]] and filtered.greedy is None
