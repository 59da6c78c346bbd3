"""Bin packing and packed model inputs: a packed batch must give each sequence's logprobs exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from llmrl.algorithms.logprobs import token_logprobs
from llmrl.algorithms.packing import (
    PackedBatch,
    SharedPrefix,
    build_batch,
    pack,
    pack_values,
    packing_efficiency,
    plan_rows,
    share_prefixes,
    unit_tokens,
    unpack,
)


def reference_first_fit_decreasing(lengths, max_tokens, max_sequences=None):
    """Textbook FFD with explicit bin contents, recomputing each bin's load every time."""
    bins = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for contents in bins:
            load = sum(lengths[j] for j in contents)
            if load + lengths[index] <= max_tokens and (
                max_sequences is None or len(contents) < max_sequences
            ):
                contents.append(index)
                break
        else:
            bins.append([index])
    return [sorted(contents) for contents in bins]


def test_pack_hand_example():
    # Decreasing order 5, 4, 3, 2: 5 opens bin 0 (3 left), 4 opens bin 1, 3 fills bin 0, 2 joins bin 1.
    assert pack([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]
    # At most 1 sequence per bin: one bin each, longest first.
    assert pack([5, 3, 4, 2], 8, max_sequences=1) == [[0], [2], [1], [3]]
    assert packing_efficiency([5, 3, 4, 2], [[0, 1], [2, 3]], 8) == 14 / 16


@pytest.mark.parametrize("max_sequences", [None, 3])
def test_pack_matches_reference_and_respects_limits(max_sequences):
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        lengths = torch.randint(
            1, 60, (int(torch.randint(1, 80, (1,), generator=generator)),), generator=generator
        )
        lengths = lengths.tolist()
        bins = pack(lengths, 64, max_sequences)
        assert bins == reference_first_fit_decreasing(lengths, 64, max_sequences), trial
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
        assert max_sequences is None or all(len(b) <= max_sequences for b in bins)
        assert 0 < packing_efficiency(lengths, bins, 64) <= 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([3, 9], 8), r"lengths\[1\]"),
        (([0], 8), r"lengths\[0\]"),
        (([3], 0), "max_tokens"),
        (([3], 8, 0), "max_sequences"),
    ],
)
def test_pack_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        pack(*args)


def test_build_batch_layout():
    sequences = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
    masks = [[False, True, True], [False, True], [False, False, True, True]]
    batch = build_batch(sequences, [[0, 1], [2]], masks, pad_token_id=99)
    assert batch.input_ids.tolist() == [[11, 12, 13, 21, 22], [31, 32, 33, 34, 99]]
    # Positions restart per sequence; padding continues the row's last sequence (3 -> 4).
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert batch.sequence_ids.tolist() == [[0, 0, 0, 1, 1], [2, 2, 2, 2, -1]]
    assert batch.loss_mask.tolist() == [[False, True, True, False, True], [False, False, True, True, False]]
    assert batch.spans == {0: ((0, 0, 3),), 1: ((0, 3, 5),), 2: ((1, 0, 4),)}
    assert batch.context_positions[0].tolist() == [0, 0, 1, 2, 3]  # column j is predicted from j - 1
    assert batch.attention_mask is None  # transformers reads the sequences from the position ids
    assert batch.num_tokens == 9
    # Default mask: every token but each sequence's first.
    assert build_batch(sequences, [[0, 1]]).loss_mask.tolist() == [[False, True, True, False, True]]


def test_pack_values_and_unpack_round_trip():
    sequences = [[1] * 4, [2] * 1, [3] * 3, [4] * 2]
    batch = build_batch(sequences, pack([len(s) for s in sequences], 5))
    values = [[float(10 * i + t) for t in range(len(s))] for i, s in enumerate(sequences)]
    laid_out = pack_values(values, batch, fill=-7.0)
    assert laid_out[batch.sequence_ids < 0].eq(-7.0).all()
    recovered = unpack(laid_out, batch)
    assert {i: v.tolist() for i, v in recovered.items()} == dict(enumerate(values))
    assert {i: v.tolist() for i, v in unpack(batch.input_ids, batch).items()} == dict(enumerate(sequences))


def test_build_batch_rejects_bad_input():
    with pytest.raises(ValueError, match="first token"):
        build_batch([[1, 2]], [[0]], [[True, True]])
    with pytest.raises(ValueError, match="distinct"):
        build_batch([[1, 2]], [[0, 0]])
    with pytest.raises(ValueError, match=r"loss_masks\[0\]"):
        build_batch([[1, 2]], [[0]], [[False]])
    with pytest.raises(ValueError, match="values"):
        pack_values([[1.0]], build_batch([[1, 2]], [[0]]))


def test_share_prefixes_groups_sequences_by_their_context():
    prompt, other = [5, 6, 7], [8, 9]
    sequences = [prompt + [1, 2], other + [3], prompt + [4], prompt + [1, 1, 1, 1], other + [6, 6], [2, 2]]
    masks = [
        [False] * (len(p)) + [True] * (len(s) - len(p))
        for p, s in zip([prompt, other, prompt, prompt, other, [2]], sequences, strict=True)
    ]
    units = share_prefixes(sequences, masks, range(6), max_tokens=100)
    assert units == [SharedPrefix((0, 2, 3), 3), SharedPrefix((1, 4), 2), 5]
    assert [unit_tokens(u, [len(s) for s in sequences]) for u in units] == [3 + 2 + 1 + 4, 2 + 1 + 2, 2]
    # A unit never exceeds max_tokens: the third member of the prompt opens a unit of its own (alone: plain).
    assert share_prefixes(sequences, masks, [0, 2, 3], max_tokens=7) == [SharedPrefix((0, 2), 3), 3]
    # Sequences without a loss token have no context to share, even when equal.
    assert share_prefixes([[1, 2], [1, 2]], [[False, False]] * 2, [0, 1], max_tokens=100) == [0, 1]
    # Only the indices asked for, in their order.
    assert share_prefixes(sequences, masks, [4, 0, 1], max_tokens=100) == [SharedPrefix((4, 1), 2), 0]


def test_build_batch_lays_a_shared_prefix_out_once():
    sequences = [[11, 12, 13, 21], [11, 12, 13, 31, 32], [41, 42]]
    masks = [[False, False, False, True], [False, False, False, True, True], [False, True]]
    batch = build_batch(sequences, [[SharedPrefix((0, 1), 3), 2]], masks, pad_token_id=99)
    assert batch.input_ids.tolist() == [[11, 12, 13, 21, 31, 32, 41, 42]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 0, 1]]
    assert batch.sequence_ids.tolist() == [[0, 0, 0, 0, 1, 1, 2, 2]]
    assert batch.loss_mask.tolist() == [[False, False, False, True, True, True, False, True]]
    # Both members' first tokens are predicted from the prompt's last token (column 2).
    assert batch.context_positions.tolist() == [[0, 0, 1, 2, 2, 4, 5, 6]]
    assert batch.num_tokens == 8 and batch.spans[1] == ((0, 0, 3), (0, 4, 6))
    allowed = batch.attention_mask[0, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],  # member 0 sees the prompt and itself
        [1, 1, 1, 0, 1, 0, 0, 0],  # member 1 sees the prompt, not member 0
        [1, 1, 1, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 0],  # a plain sequence in the same row sees only itself
        [0, 0, 0, 0, 0, 0, 1, 1],
    ]
    values = [[float(10 * i + t) for t in range(len(s))] for i, s in enumerate(sequences)]
    recovered = {i: v.tolist() for i, v in unpack(pack_values(values, batch), batch).items()}
    assert recovered == {
        0: values[0],
        1: values[0][:3] + values[1][3:],
        2: values[2],
    }  # the prefix: member 0's
    assert {i: v.tolist() for i, v in unpack(batch.input_ids, batch).items()} == dict(enumerate(sequences))


def test_plan_rows_trades_fewer_tokens_against_longer_rows():
    prompt = list(range(1, 11))
    sequences = [prompt + [100 + k] * 40 for k in range(8)] + [[7, 8, 9]]
    masks = [[False] * 10 + [True] * 40] * 8 + [[False, True, True]]
    everything = range(len(sequences))
    # Attention free: the fewest tokens, the prompt once for all 8 (10 + 8 x 40 tokens; 400 is the first
    # candidate row length that holds them: the candidates double from the longest sequence, 50).
    units, limit = plan_rows(sequences, masks, everything, 512, token_cost=1.0, pair_cost=0.0)
    assert limit == 400 and units == [SharedPrefix(tuple(range(8)), 10), 8]
    # Attention dear: every sequence in a row of its own length.
    units, limit = plan_rows(sequences, masks, everything, 512, token_cost=1.0, pair_cost=10.0)
    assert limit == 50 and units == list(everything)
    # In between: 2 completions per prompt in rows of 100 (363 tokens, ~33k attention pairs).
    units, limit = plan_rows(sequences, masks, everything, 512, token_cost=1.0, pair_cost=0.002)
    assert limit == 100
    assert units == [
        SharedPrefix((0, 1), 10),
        SharedPrefix((2, 3), 10),
        SharedPrefix((4, 5), 10),
        SharedPrefix((6, 7), 10),
        8,
    ]
    # Sharing off: plain sequences whatever the costs.
    units, _ = plan_rows(sequences, masks, everything, 512, token_cost=1.0, pair_cost=0.0, share=False)
    assert units == list(everything)


def test_plan_rows_by_sequence_packs_full_rows_however_dear_attention_is():
    # Attention over each sequence alone costs the same in any rows: what is left to save is padding.
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 90, (24,), generator=generator).tolist()
    sequences = [[1] * n for n in lengths]
    masks = [[True] * n for n in lengths]
    everything = range(len(sequences))
    dense, dense_limit = plan_rows(
        sequences, masks, everything, 1024, token_cost=1.0, pair_cost=10.0, share=False
    )
    assert dense_limit == max(lengths)  # dense masks: rows of one sequence each
    units, limit = plan_rows(
        sequences, masks, everything, 1024, token_cost=1.0, pair_cost=10.0, share=False, by_sequence=True
    )
    rows = pack([len(sequences[i]) for i in units], limit)
    padded = len(rows) * max(sum(lengths[units[j]] for j in row) for row in rows)
    single = len(sequences) * max(lengths)
    assert limit > dense_limit and padded < single  # fuller rows, less padding


@pytest.mark.parametrize(
    ("unit", "message"),
    [
        (SharedPrefix((0, 1), 2), "does not begin"),
        (SharedPrefix((0, 2), 2), "loss tokens in the shared prefix"),
        (SharedPrefix((0, 3), 2), r"must be in 1\.\.1"),
    ],
)
def test_build_batch_rejects_bad_shared_prefixes(unit, message):
    sequences = [[1, 2, 3], [1, 9, 3], [1, 2, 3], [1, 2]]
    masks = [[False, False, True], [False, False, True], [False, True, True], [False, False]]
    with pytest.raises(ValueError, match=message):
        build_batch(sequences, [[unit]], masks)


# ---------------------------------------------------------------------------------------------
# Packed forward passes through real transformers models

VOCAB = 101


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These forwards are tiny matmuls: with several threads on a busy machine, OpenMP hand-offs
    cost up to 100x the work itself (measured: 1.5 ms vs 200 ms per forward on 2 shared cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def random_causal_lm(architecture: str, attn_implementation: str) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn_implementation,
    )
    if architecture == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    return LlamaForCausalLM(LlamaConfig(**shape)).eval()


def random_sequences(seed: int, count: int = 9, longest: int = 40, vocab: int = VOCAB) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest, (count,), generator=generator).tolist()
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def alone_logprobs(model, sequence: list[int]) -> torch.Tensor:
    """The naive reference: the full model on one unpadded sequence, full log-softmax, gather."""
    ids = torch.tensor([sequence])
    logits = model(ids).logits[0].float() / 0.8
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]


def max_packed_error(model, batch: PackedBatch, sequences) -> float:
    packed = unpack(token_logprobs(model, batch, temperature=0.8)[0], batch)
    # One-token sequences have nothing to predict, but they stay in the pack as boundaries.
    return max(
        (packed[i][1:] - alone_logprobs(model, s)).abs().max().item()
        for i, s in enumerate(sequences)
        if len(s) > 1
    )


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_packed_logprobs_equal_each_sequence_alone(architecture, attn_implementation):
    model = random_causal_lm(architecture, attn_implementation)
    sequences = random_sequences(seed=1) + [[7]]  # a one-token sequence: positions 0, 0 in a row
    bins = pack([len(s) for s in sequences], max_tokens=80)
    assert len(bins) < len(sequences) and any(len(b) > 1 for b in bins)  # really packed, several rows
    batch = build_batch(sequences, bins)
    with torch.no_grad():
        assert max_packed_error(model, batch, sequences) < 1e-5
        # Control: with positions running on across sequences, transformers sees one long sequence
        # per row and tokens attend across sequence boundaries; the same check then fails.
        continuous = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids)
        assert max_packed_error(model, replace(batch, position_ids=continuous), sequences) > 1e-3


def test_packed_gradients_equal_separate_gradients():
    model = random_causal_lm("qwen2", "sdpa")
    sequences = random_sequences(seed=2, count=6)
    batch = build_batch(sequences, pack([len(s) for s in sequences], max_tokens=64))
    logprobs, _ = token_logprobs(model, batch, temperature=0.8, chunk_size=16)
    logprobs.sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sum(alone_logprobs(model, s).sum() for s in sequences).backward()
    for packed_grad, parameter in zip(packed_grads, model.parameters(), strict=True):
        torch.testing.assert_close(packed_grad, parameter.grad, rtol=1e-4, atol=1e-5)


def grouped_sequences(
    seed: int, groups: int = 3, group_size: int = 4
) -> tuple[list[list[int]], list[list[bool]]]:
    """GRPO-shaped sequences: `groups` prompts with `group_size` completions each, and their loss masks."""
    prompts = random_sequences(seed, count=groups, longest=20)
    completions = random_sequences(seed + 100, count=groups * group_size, longest=12)
    sequences = [
        prompts[g] + [1] + completions[g * group_size + k] for g in range(groups) for k in range(group_size)
    ]
    masks = [
        [False] * (len(prompts[g]) + 1) + [True] * (len(s) - len(prompts[g]) - 1)
        for g in range(groups)
        for s in sequences[g * group_size : (g + 1) * group_size]
    ]
    return sequences, masks


def shared_batch(sequences, masks, max_tokens: int) -> PackedBatch:
    units = share_prefixes(sequences, masks, range(len(sequences)), max_tokens)
    assert any(isinstance(u, SharedPrefix) for u in units)
    bins = pack([unit_tokens(u, [len(s) for s in sequences]) for u in units], max_tokens)
    return build_batch(sequences, [[units[j] for j in row] for row in bins], masks)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_shared_prefix_logprobs_equal_each_sequence_alone(architecture, attn_implementation):
    model = random_causal_lm(architecture, attn_implementation)
    sequences, masks = grouped_sequences(seed=4)
    batch = shared_batch(sequences, masks, max_tokens=60)
    assert batch.num_tokens < sum(len(s) for s in sequences)  # really shared
    with torch.no_grad():
        packed = unpack(token_logprobs(model, batch, temperature=0.8)[0], batch)
        for i, sequence in enumerate(sequences):
            start = masks[i].index(True)
            expected = alone_logprobs(model, sequence)[start - 1 :]
            torch.testing.assert_close(packed[i][start:], expected, rtol=0, atol=1e-5)
            assert not packed[i][:start].any()  # no logprob outside the loss mask


def test_shared_prefix_gradients_equal_separate_gradients():
    model = random_causal_lm("qwen2", "sdpa")
    sequences, masks = grouped_sequences(seed=5)
    weights = torch.rand(len(sequences), 40, generator=torch.Generator().manual_seed(0))
    batch = shared_batch(sequences, masks, max_tokens=200)
    logprobs, _ = token_logprobs(model, batch, temperature=0.8, chunk_size=16)
    (
        logprobs
        * pack_values([w[: len(s)].tolist() for w, s in zip(weights, sequences, strict=False)], batch)
    ).sum().backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sum(
        (alone_logprobs(model, s)[m.index(True) - 1 :] * w[m.index(True) : len(s)]).sum()
        for s, m, w in zip(sequences, masks, weights, strict=True)
    ).backward()
    for shared_grad, parameter in zip(shared_grads, model.parameters(), strict=True):
        torch.testing.assert_close(shared_grad, parameter.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_tiny_model_packed_logprobs_equal_each_sequence_alone():
    from llmrl.models import load_model

    model, _ = load_model("tiny://arithmetic")
    model = model.float().eval()
    sequences = random_sequences(
        seed=3, count=12, longest=48, vocab=model.get_output_embeddings().weight.shape[0]
    )
    batch = build_batch(sequences, pack([len(s) for s in sequences], max_tokens=128))
    with torch.no_grad():
        assert max_packed_error(model, batch, sequences) < 1e-5
