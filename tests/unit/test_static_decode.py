"""Static decode (`PagedLlamaDecoder`, `StaticSteps`, `PagedKVCache`) against the eager decoder.

On a CPU the static step runs eagerly. Without static shapes its logits equal
`LlamaFamilyDecoder`'s bit for bit (prompts inline there: the paged cache has no cascade); with
them (bucket padding, the whole table width attended: what a CUDA graph replays) they differ only
in rounding, and padded rows change nothing. tests/integration/test_cuda.py replays the graphs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmrl.config import load_config
from llmrl.config.errors import ConfigError
from llmrl.inference.decoder import LlamaFamilyDecoder, build_decoder
from llmrl.inference.engine import LocalEngine
from llmrl.inference.paged_cache import SCRATCH_BLOCK, PagedKVCache
from llmrl.inference.static_decode import PagedLlamaDecoder, bucket_of, buckets
from llmrl.types import GenerationArgs, InferenceRequest
from tests.unit.test_engine import _build, _last_logits, tokenizer  # noqa: F401  (a fixture)

EAGER = 10**9
"""`share_from` of a reference decoder that copies every prompt into its rows."""


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Tiny matmuls: one thread is as fast, and a busy neighbour core cannot stall it."""


def test_buckets_are_powers_of_two_then_multiples_of_16():
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert buckets(5) == [1, 2, 4, 8]
    assert buckets(1) == [1]
    assert buckets(70) == [1, 2, 4, 8, 16, 32, 48, 64, 80]
    sizes = buckets(64)
    assert [bucket_of(rows, sizes) for rows in (1, 3, 8, 9, 33, 64, 65, 100)] == [
        1,
        4,
        8,
        16,
        48,
        64,
        80,
        112,
    ]


class _Twin:
    """A reference decoder and a paged one fed the same joins, tokens and removals."""

    def __init__(self, model, static_shapes: bool, max_rows: int = 8):
        self.model = model
        self.reference = LlamaFamilyDecoder(model, share_from=EAGER)
        # A pool of 1 + 2 x max_rows blocks (no tokens reserved): with 2 rows, the scenario outgrows it.
        self.paged = PagedLlamaDecoder(
            model, max_rows=max_rows, reserve_tokens=0, static_shapes=static_shapes
        )
        self.generator = torch.Generator().manual_seed(0)
        self.sequences: list[list[int]] = []

    def join(self, lengths: list[int], copies: list[int]) -> None:
        prompts = [torch.randint(0, 97, (n,), generator=self.generator).tolist() for n in lengths]
        assert torch.equal(self.reference.prefill(prompts, copies), self.paged.prefill(prompts, copies))
        self.sequences.extend(list(p) for p, c in zip(prompts, copies, strict=True) for _ in range(c))

    def remove(self, rows: list[int]) -> None:
        order = self.reference.remove_rows(rows)
        assert self.paged.remove_rows(rows) == order
        self.sequences = [self.sequences[i] for i in order]

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 97, (self.reference.num_rows,), generator=self.generator)
        for sequence, token in zip(self.sequences, tokens.tolist(), strict=True):
            sequence.append(token)
        return self.reference.decode(tokens), self.paged.decode(tokens)

    def run(self, check) -> None:
        """Joins and removals of every kind: whole blocks shared by a group, tails copied, a prompt of
        exactly one block, rows leaving before their first step, a one-token prompt."""
        self.join([5, 3, 40], [2, 1, 3])  # 40 tokens: two whole blocks shared by 3 rows, 8 in each tail
        for step in range(24):
            reference, paged = self.step()
            check(reference, paged)
            if step in (0, 11, 23):
                torch.testing.assert_close(paged, _last_logits(self.model, self.sequences), rtol=0, atol=1e-4)
            if step in (3, 6):
                self.remove([0, 2, self.reference.num_rows - 1])
            if step == 5:
                self.join([32, 3], [1, 4])  # exactly two blocks: the row's first step takes a new block
                self.remove([1])  # leaves before any decode step
            if step == 8:
                self.remove(list(range(self.reference.num_rows // 2)))
                self.join([17], [5])
            if step == 10:
                self.join([1], [1])


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_paged_decoder_equals_the_eager_decoder_bit_for_bit(family):
    twin = _Twin(_build(family, 97), static_shapes=False, max_rows=2)
    with torch.inference_mode():
        twin.run(lambda reference, paged: torch.testing.assert_close(paged, reference, rtol=0, atol=0))
    assert twin.paged.cache.version > 1  # the pool grew under running rows
    twin.paged.remove_rows(list(range(twin.paged.num_rows)))
    cache = twin.paged.cache
    assert len(cache.free) == cache.num_blocks - 1 and not any(cache.references)  # every block back


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_static_shapes_differ_from_the_eager_decoder_only_in_rounding(family):
    twin = _Twin(_build(family, 97), static_shapes=True)
    steps, stepped = twin.paged.steps, []
    function = steps.function
    steps.function = lambda tokens, *rest: (
        stepped.append((len(tokens), twin.paged.num_rows)) or function(tokens, *rest)
    )
    with torch.inference_mode():
        twin.run(lambda reference, paged: torch.testing.assert_close(paged, reference, rtol=0, atol=2e-5))
    assert {bucket for bucket, _ in stepped} == {4, 8}
    assert any(bucket > rows for bucket, rows in stepped)  # padded rows stepped beside live ones


def test_captured_steps_serve_later_batches_until_the_pool_grows():
    # On a CPU, capturing keeps the stand-in of a CUDA graph: the same bookkeeping, replayed eagerly.
    model = _build("qwen2", 97)
    graphed = PagedLlamaDecoder(model, max_rows=4, reserve_tokens=64, capture=True)  # 13 blocks
    plain = PagedLlamaDecoder(model, max_rows=4, reserve_tokens=64, static_shapes=True)
    prompt, tokens = list(range(3, 12)), torch.tensor([20, 21, 22])

    def batch(decoder: PagedLlamaDecoder, steps: int) -> list[torch.Tensor]:
        decoder.prefill([prompt], [3])
        logits = [decoder.decode(tokens) for _ in range(steps)]
        decoder.reset()
        return logits

    with torch.inference_mode():
        first = batch(graphed, 5)  # 3 rows in bucket 4, 9..13 positions: a table one block wide
        assert graphed.steps.captures == 1
        again = batch(graphed, 5)
        assert graphed.steps.captures == 1  # the pool stayed: the same graph served the next batch
        reference = batch(plain, 5)
        for step in range(5):  # each replay's logits are a copy, not the buffer the next one overwrites
            torch.testing.assert_close(first[step], reference[step], rtol=0, atol=0)
            torch.testing.assert_close(again[step], reference[step], rtol=0, atol=0)
        version = graphed.cache.version
        longer = batch(graphed, 12)  # 20 positions: two blocks wide, a second graph
        assert graphed.steps.captures == 2
        graphed.prefill([[i % 97 for i in range(150)]], [8])  # outgrows the pool: a new one, graphs dropped
        assert graphed.cache.version > version
        graphed.decode(torch.arange(8))
        assert graphed.steps.captures == 3 and len(graphed.steps._graphs) == 1
    torch.testing.assert_close(longer[:5], reference, rtol=0, atol=0)


def test_padded_rows_and_masked_cells_change_nothing():
    decoder = PagedLlamaDecoder(_build("qwen2", 97), max_rows=16, static_shapes=True)
    with torch.inference_mode():
        decoder.prefill([list(range(3, 40)), [5, 6, 7]], [2, 1])
        decoder.decode(torch.tensor([8, 9, 10]))
        cache = decoder.cache
        cache.prepare_step()
        rows, width = cache.table.shape
        generator = torch.Generator().manual_seed(1)

        def step(padding_tokens: torch.Tensor, padding_lengths: torch.Tensor, scratch: float) -> torch.Tensor:
            pools = cache.pool_k.clone(), cache.pool_v.clone()
            for pool in (cache.pool_k, cache.pool_v):  # what padded rows wrote in earlier steps
                pool[:, SCRATCH_BLOCK] = scratch
            tokens = torch.cat([torch.tensor([11, 12, 13]), padding_tokens])
            lengths = torch.cat([cache.lengths, padding_lengths])
            table = torch.cat([cache.table, torch.full((4 - rows, width), SCRATCH_BLOCK)])
            logits = decoder._step(tokens, lengths, table, width * cache.BLOCK)[:rows]
            cache.pool_k, cache.pool_v = pools
            return logits

        plain = step(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0.0)
        noisy = step(torch.randint(0, 97, (1,), generator=generator), torch.tensor([5]), 1e4)
        torch.testing.assert_close(noisy, plain, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_packed_prefill_attends_prompts_by_their_boundaries(family):
    # End to end, no padding, no mask (on CUDA flash attention's variable-length kernel; here its
    # span-by-span reference): the padded prefill's logits and cache, to rounding.
    model = _build(family, 97)
    padded = PagedLlamaDecoder(model, max_rows=8)
    packed = PagedLlamaDecoder(model, max_rows=8, packed_prefill=True)
    assert not padded.packed_prefill  # off on a CPU by default: the padded path is the default decoder's
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=generator).tolist() for n in (5, 40, 17, 1)]
    copies = [2, 3, 1, 1]
    sequences = [list(p) for p, c in zip(prompts, copies, strict=True) for _ in range(c)]
    with torch.inference_mode():
        first = packed.prefill(prompts, copies)
        torch.testing.assert_close(first, padded.prefill(prompts, copies), rtol=0, atol=2e-5)
        torch.testing.assert_close(packed.cache.pool_k, padded.cache.pool_k, rtol=0, atol=2e-5)
        torch.testing.assert_close(packed.cache.pool_v, padded.cache.pool_v, rtol=0, atol=2e-5)
        for _ in range(3):
            tokens = torch.randint(0, 97, (len(sequences),), generator=generator)
            sequences = [s + [t] for s, t in zip(sequences, tokens.tolist(), strict=True)]
            logits = packed.decode(tokens)
    torch.testing.assert_close(logits, _last_logits(model, sequences), rtol=0, atol=1e-4)


def test_rows_up_to_the_end_of_the_context():
    # 160 positions are 10 blocks: the table's width (a power of two) passes the context.
    model = _build("qwen2", 97)
    decoder = PagedLlamaDecoder(model, max_rows=4, static_shapes=True)
    sequences = [[i % 97 for i in range(150)]] * 3
    with torch.inference_mode():
        decoder.prefill(sequences[:1], [3])
        for token in range(9):
            logits = decoder.decode(torch.tensor([token, token + 1, token + 2]))
            sequences = [s + [token + i] for i, s in enumerate(sequences)]
    assert decoder.cache.table.shape[1] == 16 and len(sequences[0]) == 159
    torch.testing.assert_close(logits, _last_logits(model, sequences), rtol=0, atol=1e-4)


def test_weights_loaded_and_merged_in_place_serve_at_once():
    twin = _Twin(_build("qwen2", 97), static_shapes=False)
    other = _build("qwen2", 97, seed=5).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    delta = {name: torch.randn(other[name].shape, generator=torch.Generator().manual_seed(2)) * 0.1}
    with torch.inference_mode():
        twin.join([20, 4], [3, 2])
        twin.step()
        weights = twin.paged.weights.layers[0].qkv_weight
        for decoder in (twin.reference, twin.paged):
            decoder.load_state_dict(other)
        assert twin.paged.weights.layers[0].qkv_weight is weights  # copied into, not replaced
        reference, paged = twin.step()
        torch.testing.assert_close(paged, reference, rtol=0, atol=0)
        for decoder in (twin.reference, twin.paged):
            decoder.merge_deltas(delta)
        reference, paged = twin.step()
        torch.testing.assert_close(paged, reference, rtol=0, atol=0)


def test_paged_cache_shares_whole_prompt_blocks_and_frees_them_with_the_last_row():
    cache = PagedKVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        device=torch.device("cpu"),
        dtype=torch.float32,
        reserve_tokens=64,
        max_rows=4,
    )
    plan = cache.add_rows([35], [3])  # 2 whole blocks shared, 3 positions in each row's own tail block
    shared = cache.row_blocks[0][:2]
    assert all(blocks[:2] == shared for blocks in cache.row_blocks)
    assert len({blocks[2] for blocks in cache.row_blocks}) == 3
    assert [cache.references[b] for b in shared] == [3, 3]
    assert len(plan.blocks) == 32 + 3 * 3  # shared positions written once, tails once per row
    assert SCRATCH_BLOCK not in {b for blocks in cache.row_blocks for b in blocks}
    free = len(cache.free)
    cache.remove_rows([0, 1])
    assert len(cache.free) == free + 2 and [cache.references[b] for b in shared] == [1, 1]
    cache.remove_rows([0])
    assert len(cache.free) == cache.num_blocks - 1
    pool = cache.pool_k
    cache.reset()  # on a CPU the pool stays for the next batch
    assert cache.pool_k is pool and cache.num_rows == 0


def test_engine_with_cuda_graphs_on_gives_the_tokens_and_logprobs_of_off(tokenizer):  # noqa: F811
    model = _build("qwen2", len(tokenizer))
    prompt = " ".join(f"the fox counts {i} + {2 * i} = {3 * i}." for i in range(3))
    requests = [
        InferenceRequest(prompt=prompt, n=6, generation_args=GenerationArgs(max_tokens=24, seed=1)),
        InferenceRequest(
            prompt="12 + 35 =", n=3, generation_args=GenerationArgs(max_tokens=30, temperature=0.7, seed=2)
        ),
        InferenceRequest(
            prompt="the quick brown fox",
            n=2,
            generation_args=GenerationArgs(
                max_tokens=20,
                seed=3,
                repetition_penalty=1.3,
                presence_penalty=0.5,
                min_tokens=5,
                stop=["dog"],
            ),
        ),
        InferenceRequest(prompt="a", generation_args=GenerationArgs(max_tokens=9, temperature=0.0)),
    ]
    results = {}
    for graphs in ("on", "off"):
        engine = LocalEngine(copy.deepcopy(model), tokenizer, seed=0, cuda_graphs=graphs, max_concurrent=8)
        try:
            assert isinstance(engine._decoder, PagedLlamaDecoder) == (graphs == "on")
            first = [engine.generate(r) for r in requests]
            follow_up = InferenceRequest(
                prompt=" and then",
                prompt_token_ids=first[0][0].prompt_token_ids + first[0][0].token_ids + [5, 6],
                n=2,
                generation_args=GenerationArgs(max_tokens=12, seed=4),
            )
            results[graphs] = [*first, engine.generate(follow_up)]
        finally:
            engine.close()
    for on, off in zip(results["on"], results["off"], strict=True):
        assert [(r.token_ids, r.logprobs, r.finish_reason) for r in on] == [
            (r.token_ids, r.logprobs, r.finish_reason) for r in off
        ]


def test_cuda_graphs_on_refuses_a_model_the_compact_decoder_does_not_serve():
    with pytest.raises(ValueError, match="inference.cuda_graphs: on needs a Llama or Qwen2"):
        build_decoder(_build("gpt2", 97), cuda_graphs="on")


def test_cuda_graphs_config_field_is_checked():
    assert load_config(None, []).inference.cuda_graphs == "auto"
    assert load_config(None, ["inference.cuda_graphs=on"]).inference.cuda_graphs == "on"  # YAML's true
    assert load_config(None, ["inference.cuda_graphs=off"]).inference.cuda_graphs == "off"
    with pytest.raises(ConfigError, match="inference.cuda_graphs"):
        load_config(None, ["inference.cuda_graphs=always"])
