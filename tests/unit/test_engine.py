"""LocalEngine against naive references: Hugging Face `generate`, teacher-forced logprobs, full forwards.

The correctness checks run on the tiny model (`tiny://arithmetic`, built once per cache) and on
small random models that cover what it does not: Llama with biases, one kv head and an untied head
(the fast path's other corners) and GPT-2 (the generic fallback). The random models use a
byte-level BPE tokenizer trained in a fixture and a large ``initializer_range``, so logits are
peaked and greedy decoding has no near-ties that float rounding could flip.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import math
import threading
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from llmrl.algorithms.logprobs import selective_log_softmax
from llmrl.config import InferenceConfig, ModelConfig
from llmrl.inference import build_inference
from llmrl.inference.decoder import HFDecoder, LlamaFamilyDecoder, build_decoder
from llmrl.inference.engine import LocalEngine
from llmrl.inference.interface import InferenceInterface
from llmrl.models.shape import tied_duplicates
from llmrl.trainer.passes import sampling_params
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest
from llmrl.weights import weight_buckets

CONTEXT = 160
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PROMPTS = [
    "the quick brown fox",
    "12 + 35 =",
    "a",
    "jumps over the lazy dog and then the fox says 7 * 8 = 56",
]
LONG_PROMPT = " ".join(f"the fox counts {i} + {2 * i} = {3 * i}." for i in range(8))


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Tiny matmuls: one thread is as fast, and a busy neighbour core cannot stall it."""


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [f"the quick brown fox jumps over the lazy dog {i} + {3 * i} = {4 * i}" for i in range(300)]
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<|endoftext|>", eos_token="<|im_end|>", chat_template=CHATML
    )


def _build(family: str, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, initializer_range=0.2, eos_token_id=2, pad_token_id=0)
    if family == "qwen2":
        config = Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=CONTEXT,
            tie_word_embeddings=True,
            **common,
        )
        return Qwen2ForCausalLM(config).eval()
    if family == "llama":  # biases everywhere, one kv head, untied head: the other corners of the family
        config = LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=CONTEXT,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            **common,
        )
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():  # biases start at zero; make them matter
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.2)
        return model
    assert family == "gpt2"
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=CONTEXT, **common)
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module", params=["tiny", "qwen2", "llama", "gpt2"])
def served(request, tokenizer):
    """(model, tokenizer) pairs the correctness tests run on."""
    if request.param == "tiny":
        return request.getfixturevalue("tiny_model")
    return _build(request.param, len(tokenizer)), tokenizer


@pytest.fixture(scope="module", params=["tiny", "qwen2"])
def fast_served(request, tokenizer):
    """The fast path's (model, tokenizer): the tiny model and a random Qwen2."""
    if request.param == "tiny":
        return request.getfixturevalue("tiny_model")
    return _build(request.param, len(tokenizer)), tokenizer


@pytest.fixture(scope="module")
def qwen2(tokenizer) -> torch.nn.Module:
    return _build("qwen2", len(tokenizer))


async def _gather(engine: LocalEngine, requests: list[InferenceRequest], return_exceptions: bool = False):
    return await asyncio.gather(*(engine.agenerate(r) for r in requests), return_exceptions=return_exceptions)


def _teacher_forced(
    model,
    prompt_ids: list[int],
    completion: list[int],
    temperature: float,
    args: GenerationArgs | None = None,
) -> torch.Tensor:
    """Logprobs of each completion token from one full forward pass, as the trainer takes them:
    log softmax(logits / T), renormalised over what `args`' min-p/top-k/top-p keep."""
    ids = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    targets = torch.tensor(completion)
    if args is None:
        return selective_log_softmax(logits, targets, temperature)[0]
    each = [args] * len(completion)  # per-token options, as the trainer lays them out
    return selective_log_softmax(logits, targets, sampling_params(each, ["response"] * len(each)))[0]


def test_engine_is_an_inference_interface(qwen2, tokenizer):
    engine = LocalEngine(qwen2, tokenizer)
    assert isinstance(engine, InferenceInterface)
    assert engine.uses_fast_path
    assert isinstance(build_decoder(_build("gpt2", len(tokenizer))), HFDecoder)


def test_built_from_config_through_the_registry(tokenizer, tmp_path):
    _build("qwen2", len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = build_inference(
        InferenceConfig(max_concurrent=5, max_batch_tokens=999), ModelConfig(spec=str(tmp_path)), seed=3
    )
    assert isinstance(engine, LocalEngine) and engine.uses_fast_path
    assert (engine.max_concurrent, engine.max_batch_tokens) == (5, 999)
    (response,) = engine.generate(
        InferenceRequest(prompt="fox", generation_args=GenerationArgs(max_tokens=4))
    )
    assert len(response.token_ids) <= 4


@pytest.mark.cross_cpu
def test_greedy_matches_generate_token_for_token(served):
    # Requests of different lengths run concurrently in one batch; each must equal its own generate().
    model, tokenizer = served
    eos = tokenizer.eos_token_id
    engine = LocalEngine(model, tokenizer)
    requests = [
        InferenceRequest(prompt=p, generation_args=GenerationArgs(temperature=0.0, max_tokens=40))
        for p in PROMPTS
    ]
    chat = [ChatMessage(role="user", content="what is 12 + 35?")]
    requests.append(
        InferenceRequest(prompt=chat, n=3, generation_args=GenerationArgs(temperature=0.0, max_tokens=30))
    )
    results = asyncio.run(_gather(engine, requests))
    assert engine.uses_fast_path == (not isinstance(model, GPT2LMHeadModel))
    for request, responses in zip(requests, results, strict=True):
        prompt_ids = responses[0].prompt_token_ids
        if isinstance(request.prompt, str):
            assert prompt_ids == tokenizer(request.prompt)["input_ids"]
        else:
            assert prompt_ids == tokenizer.apply_chat_template(
                [m.model_dump() for m in chat], add_generation_prompt=True, return_dict=False
            )
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt_ids]),
                do_sample=False,
                max_new_tokens=request.generation_args.max_tokens,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt_ids) :].tolist()
        assert len(responses) == request.n
        for response in responses:
            assert response.token_ids == expected
            assert response.finish_reason == ("stop" if expected[-1] == eos else "length")
            assert response.text == tokenizer.decode(expected, skip_special_tokens=True)
            # Greedy reports the temperature-1 logprob of the chosen token.
            torch.testing.assert_close(
                torch.tensor(response.logprobs),
                _teacher_forced(model, prompt_ids, expected, 1.0),
                rtol=0,
                atol=1e-4,
            )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced_forward(served, temperature):
    model, tokenizer = served
    engine = LocalEngine(model, tokenizer)
    # Filters renormalise the distribution; the trainer's logprobs of a forward pass follow them.
    args = [
        GenerationArgs(temperature=temperature, max_tokens=30, seed=1),
        GenerationArgs(temperature=temperature, max_tokens=25, top_k=5, top_p=0.9, seed=2),
        GenerationArgs(temperature=temperature, max_tokens=25, min_p=0.05, seed=3),
        GenerationArgs(temperature=temperature, max_tokens=25, top_p=0.7, min_p=0.02, top_k=20, seed=4),
    ]
    requests = [
        InferenceRequest(prompt=p, n=3, generation_args=a) for p, a in zip(PROMPTS, args, strict=True)
    ]
    # A group long enough to keep one shared copy of its prompt (cascade attention on the fast path).
    requests.append(InferenceRequest(prompt=LONG_PROMPT, n=8, generation_args=args[0]))
    assert len(tokenizer(LONG_PROMPT)["input_ids"]) * 7 >= LlamaFamilyDecoder.SHARE_FROM
    for request, responses in zip(requests, asyncio.run(_gather(engine, requests)), strict=True):
        for response in responses:
            assert len(response.logprobs) == len(response.token_ids) > 0
            expected = _teacher_forced(
                model, response.prompt_token_ids, response.token_ids, temperature, request.generation_args
            )
            assert (torch.tensor(response.logprobs) - expected).abs().max().item() < 1e-4


def test_penalised_logprobs_equal_a_forward_pass_with_the_same_penalties(fast_served):
    """Repetition (Hugging Face's processor as the reference) and presence penalties and min_tokens
    change the distribution sampled from; the logprobs describe that distribution."""
    from transformers import RepetitionPenaltyLogitsProcessor

    model, tokenizer = fast_served
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = LocalEngine(model, tokenizer, eos_token_ids=[eos])
    args = GenerationArgs(
        temperature=0.8, max_tokens=20, repetition_penalty=1.5, presence_penalty=0.7, min_tokens=6, seed=5
    )
    request = InferenceRequest(
        prompt=[ChatMessage(role="user", content="What is 12 + 35?")], n=4, generation_args=args
    )
    repetition = RepetitionPenaltyLogitsProcessor(args.repetition_penalty)
    for response in engine.generate(request):
        assert eos not in response.token_ids[: args.min_tokens]
        ids = torch.tensor([response.prompt_token_ids + response.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(response.prompt_token_ids) - 1 : -1].float()
        for j, token in enumerate(response.token_ids):
            context = ids[:, : len(response.prompt_token_ids) + j]
            scores = repetition(context, logits[j : j + 1].clone())[0]
            scores[torch.tensor(sorted(set(response.token_ids[:j])), dtype=torch.long)] -= (
                args.presence_penalty
            )
            if j < args.min_tokens:
                scores[eos] = -math.inf
            expected = torch.log_softmax(scores / args.temperature, dim=-1)[token].item()
            assert abs(response.logprobs[j] - expected) < 1e-4, (j, response.logprobs[j], expected)


def test_ignore_eos_goes_on_to_max_tokens(tiny_model):
    model, tokenizer = tiny_model
    engine = LocalEngine(model, tokenizer)
    prompt = [ChatMessage(role="user", content="What is 12 + 35?")]
    (stopped,) = engine.generate(
        InferenceRequest(prompt=prompt, generation_args=GenerationArgs(temperature=0))
    )
    assert stopped.finish_reason == "stop"
    (going,) = engine.generate(
        InferenceRequest(
            prompt=prompt, generation_args=GenerationArgs(temperature=0, ignore_eos=True, max_tokens=12)
        )
    )
    assert going.finish_reason == "length" and len(going.token_ids) == 12
    assert going.token_ids[: len(stopped.token_ids)] == stopped.token_ids


def test_chat_template_kwargs_reach_the_template(tokenizer, qwen2):
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = CHATML.replace(
        "{%- if add_generation_prompt %}",
        "{%- if add_generation_prompt %}{%- if not think %}{{- 'no ' }}{%- endif %}",
    )
    engine = LocalEngine(qwen2, templated)
    chat = [ChatMessage(role="user", content="a")]
    plain, thinking = (
        engine.generate(
            InferenceRequest(
                prompt=chat, generation_args=GenerationArgs(max_tokens=1, chat_template_kwargs=kwargs)
            )
        )[0]
        for kwargs in (None, {"think": True})
    )
    assert templated.decode(plain.prompt_token_ids).endswith("no <|im_start|>assistant\n")
    assert templated.decode(thinking.prompt_token_ids).endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.cross_cpu
def test_same_seed_same_tokens_alone_or_beside_30_others(fast_served):
    model, tokenizer = fast_served
    engine = LocalEngine(model, tokenizer, max_concurrent=64, eos_token_ids=())  # long completions
    target = InferenceRequest(
        prompt="the lazy dog", n=2, generation_args=GenerationArgs(max_tokens=40, seed=1234, temperature=3.0)
    )
    (alone,) = asyncio.run(_gather(engine, [target]))
    others = [
        InferenceRequest(
            prompt=PROMPTS[i % 4] + " " * (i % 3),
            n=1 + i % 2,
            generation_args=GenerationArgs(
                temperature=0.5 + 0.1 * (i % 7), top_k=i % 4 * 10, max_tokens=10 + 3 * i, seed=i
            ),
        )
        for i in range(30)
    ]
    results = asyncio.run(_gather(engine, others[:15] + [target] + others[15:]))
    beside = results[15]
    assert [r.token_ids for r in beside] == [r.token_ids for r in alone]
    # Logits can differ in the last float bits between batch shapes (BLAS blocking), not more.
    torch.testing.assert_close(
        torch.tensor([r.logprobs for r in beside]),
        torch.tensor([r.logprobs for r in alone]),
        rtol=0,
        atol=1e-4,
    )
    # The two samples of a request differ; sample 0 equals the n=1 request with that seed.
    assert alone[0].token_ids != alone[1].token_ids
    (single,) = engine.generate(target.model_copy(update={"n": 1}))
    assert single.token_ids == alone[0].token_ids
    # Unseeded requests differ from run to run. Both requests sample hot: the tiny model puts ~0.998 on
    # eos after eos, so at temperature 1 two samples can both be all eos.
    unseeded = InferenceRequest(
        prompt="the lazy dog", generation_args=GenerationArgs(max_tokens=40, temperature=3.0)
    )
    assert engine.generate(unseeded)[0].token_ids != engine.generate(unseeded)[0].token_ids


def test_update_weights_serves_new_weights(fast_served, tmp_path):
    served_model, tokenizer = fast_served
    model = copy.deepcopy(served_model)  # the tiny model is shared by the session: update a copy
    old_model = copy.deepcopy(served_model)
    engine = LocalEngine(model, tokenizer, eos_token_ids=())
    request = InferenceRequest(
        prompt="the quick", generation_args=GenerationArgs(temperature=0.7, max_tokens=20, seed=5)
    )
    (before,) = engine.generate(request)
    assert before.policy_version == 0
    new_model = copy.deepcopy(served_model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in new_model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    # What the trainer sends: tied weights once (the LM head follows its embedding).
    tied = tied_duplicates(new_model)
    assert tied == {"lm_head.weight"}
    engine.update_weights({k: v for k, v in new_model.state_dict().items() if k not in tied}, version=3)
    (after,) = engine.generate(request)
    assert after.policy_version == engine.policy_version == 3
    new_logprobs = _teacher_forced(new_model, after.prompt_token_ids, after.token_ids, 0.7)
    assert (torch.tensor(after.logprobs) - new_logprobs).abs().max().item() < 1e-4
    old_logprobs = _teacher_forced(old_model, after.prompt_token_ids, after.token_ids, 0.7)
    assert (torch.tensor(after.logprobs) - old_logprobs).abs().max().item() > 0.05

    # From a safetensors file, a subset of the parameters (one layer's MLP).
    from safetensors.torch import save_file

    layer = {
        k: v.clone() * 3 for k, v in new_model.state_dict().items() if k.startswith("model.layers.0.mlp.")
    }
    save_file(layer, tmp_path / "update.safetensors")
    engine.update_weights(tmp_path / "update.safetensors", version=4)
    (third,) = engine.generate(request)
    for key, value in layer.items():
        assert torch.equal(model.state_dict()[key], value)
    expected = _teacher_forced(model, third.prompt_token_ids, third.token_ids, 0.7)
    assert third.policy_version == 4
    assert (torch.tensor(third.logprobs) - expected).abs().max().item() < 1e-4


def test_streamed_buckets_update_like_one_state_dict(fast_served):
    served_model, tokenizer = fast_served
    new_model = copy.deepcopy(served_model)
    with torch.no_grad():
        for param in new_model.parameters():
            param.mul_(1.1)
    state = {k: v for k, v in new_model.state_dict().items() if k not in tied_duplicates(new_model)}
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    names = weight_buckets(list(state), sizes, bucket_bytes=1 << 16)
    assert len(names) > 2
    request = InferenceRequest(prompt="the quick", generation_args=GenerationArgs(max_tokens=12, seed=5))
    responses = []
    for weights in (state, ({name: state[name] for name in bucket} for bucket in names)):
        engine = LocalEngine(copy.deepcopy(served_model), tokenizer, eos_token_ids=())
        engine.update_weights(weights, version=2)
        responses.append(engine.generate(request)[0])
    assert responses[0].policy_version == responses[1].policy_version == 2
    assert responses[0].token_ids == responses[1].token_ids and responses[0].logprobs == responses[1].logprobs

    # A bad bucket raises; the version stays until an update completes.
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights(iter([{"model.norm.weight": torch.zeros(3)}]), version=3)
    assert engine.policy_version == 2


def test_update_weights_rejects_bad_state_dicts(qwen2, tokenizer, tmp_path):
    engine = LocalEngine(qwen2, tokenizer)
    with pytest.raises(ValueError, match="keys the model does not have"):
        engine.update_weights({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)}, version=1)
    with pytest.raises(ValueError, match="version"):
        engine.update_weights({}, version=-1)
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        engine.update_weights(tmp_path / "missing", version=1)
    assert engine.policy_version == 0


def _weight_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (meta placeholders hold none)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if t is not None and not t.is_meta
    }
    return sum(storages.values())


def _engine_weight_bytes(engine: LocalEngine) -> int:
    """The engine's resident weights: its model's tensors and its decoder's fused ones."""
    tensors = list(engine.model.state_dict().values())
    if isinstance(engine._decoder, LlamaFamilyDecoder):
        weights = engine._decoder.weights
        tensors += [
            weights.embed,
            weights.final_norm,
            weights.lm_head,
            weights.lm_head_bias,
            *(t for layer in weights.layers for t in layer),
        ]
    return _weight_bytes(tensors)


def _decoder_logits(engine: LocalEngine) -> torch.Tensor:
    """Logits of a prefill of two prompts (one shared by 3 rows) and of the decode step after it."""
    decoder = engine._decoder
    with torch.inference_mode():
        prefill = decoder.prefill([[5, 6, 7, 8, 9, 10], [11, 12]], [3, 1])
        step = decoder.decode(torch.tensor([13, 14, 15, 16]))
        decoder.reset()
    return torch.cat([prefill, step])


@pytest.mark.parametrize("family", ["tiny", "qwen2", "llama", "gpt2"])
def test_an_engine_that_owns_its_model_holds_one_copy_of_its_weights(family, tokenizer, request):
    if family == "tiny":
        original, tokenizer = request.getfixturevalue("tiny_model")
    else:
        original = _build(family, len(tokenizer))
    one_copy = _weight_bytes(original.state_dict().values())
    assert _engine_weight_bytes(LocalEngine(copy.deepcopy(original), tokenizer)) > one_copy * (
        family != "gpt2"
    )  # a model the caller keeps: the fused copies come on top of it
    engine = LocalEngine(copy.deepcopy(original), tokenizer, owns_model=True)
    assert _engine_weight_bytes(engine) == one_copy
    released = {name for name, tensor in engine.model.state_dict().items() if tensor.is_meta}
    assert released == (set() if family == "gpt2" else set(engine._decoder.fused))

    new_model = copy.deepcopy(original)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in new_model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    engine.update_weights(
        {k: v for k, v in new_model.state_dict().items() if k not in tied_duplicates(new_model)}, version=1
    )
    torch.testing.assert_close(
        _decoder_logits(engine),
        _decoder_logits(LocalEngine(copy.deepcopy(new_model), tokenizer)),
        rtol=0,
        atol=1e-6,
    )

    # A part of one layer, streamed in buckets: the q projection (and its bias where there is one)
    # and the gate projection; every other tensor keeps the full update's values.
    layer = "transformer.h.1.attn.c_attn" if family == "gpt2" else "model.layers.1.self_attn.q_proj"
    gate = "transformer.h.1.mlp.c_fc" if family == "gpt2" else "model.layers.1.mlp.gate_proj"
    part = {k: v * 1.5 for k, v in new_model.state_dict().items() if k.startswith((layer + ".", gate + "."))}
    assert any(k.endswith(".bias") for k in part)
    engine.update_weights(iter([{k: v} for k, v in part.items()]), version=2)
    new_model.load_state_dict(part, strict=False)
    torch.testing.assert_close(
        _decoder_logits(engine),
        _decoder_logits(LocalEngine(copy.deepcopy(new_model), tokenizer)),
        rtol=0,
        atol=1e-6,
    )
    assert _engine_weight_bytes(engine) == one_copy

    # Updates are still checked against the released tensors' shapes.
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights({layer + ".weight": torch.zeros(3)}, version=3)
    assert engine.policy_version == 2


def _long_request(max_tokens: int = 100, prompt: str = "the quick brown fox") -> InferenceRequest:
    return InferenceRequest(prompt=prompt, generation_args=GenerationArgs(max_tokens=max_tokens, seed=0))


@pytest.mark.parametrize("caller", ["thread", "loop"])
@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_weight_update_during_generation(tokenizer, mode, caller):
    # caller "thread": update_weights from another thread while the loop steps the batch;
    # "loop": called (blocking) from a coroutine of the very loop that steps it.
    model = _build("qwen2", len(tokenizer))
    engine = LocalEngine(model, tokenizer, eos_token_ids=(), weight_update=mode)
    new_state = _build("qwen2", len(tokenizer), seed=1).state_dict()

    async def scenario():
        running = asyncio.ensure_future(engine.agenerate(_long_request(150)))
        while engine.stats.completion_tokens < 10:  # the request is in flight
            await asyncio.sleep(0.001)
        if caller == "thread":
            await asyncio.get_running_loop().run_in_executor(None, engine.update_weights, new_state, 7)
        else:
            engine.update_weights(new_state, 7)  # must not wait for a loop it blocks
        (old,) = await running
        (new,) = await engine.agenerate(_long_request(5))
        return old, new

    old, new = asyncio.run(scenario())
    assert old.policy_version == 0 and new.policy_version == 7
    if mode == "wait":
        assert old.finish_reason == "length" and len(old.token_ids) == 150
        # Finished on the old weights: its logprobs are the old model's.
        expected = _teacher_forced(_build("qwen2", len(tokenizer)), old.prompt_token_ids, old.token_ids, 1.0)
        assert (torch.tensor(old.logprobs) - expected).abs().max().item() < 1e-4
    else:
        assert old.finish_reason == "abort" and 10 <= len(old.token_ids) < 150
        assert len(old.logprobs) == len(old.token_ids)


def test_in_flight_update_continues_running_sequences_on_the_new_weights(tokenizer):
    model = _build("qwen2", len(tokenizer))
    engine = LocalEngine(model, tokenizer, eos_token_ids=(), weight_update="in_flight")
    new_model = _build("qwen2", len(tokenizer), seed=1)
    request = InferenceRequest(
        prompt="the quick brown fox", n=2, generation_args=GenerationArgs(max_tokens=30, seed=0)
    )

    async def scenario():
        running = asyncio.ensure_future(engine.agenerate(request))
        for _ in range(12):  # the driver runs one engine step per turn of the loop
            await asyncio.sleep(0)
        engine.update_weights(new_model.state_dict(), 7)  # applied before the next step
        later = await engine.agenerate(_long_request(5))
        return await running, later

    spanning, (later,) = asyncio.run(scenario())
    assert later.policy_version == 7 and later.version_changes == []
    old_model = _build("qwen2", len(tokenizer))
    for sample in spanning:
        assert sample.finish_reason == "length" and len(sample.token_ids) == 30
        ((switch, version),) = sample.version_changes
        assert sample.policy_version == 0 and version == 7 and 1 < switch < 30
        assert sample.token_versions() == [0] * switch + [7] * (30 - switch)
        # Token `switch - 1` was sampled on the old weights and fed to the new ones: the cache holds
        # the old weights' keys and values up to it, the new weights' from it on.
        prompt, tokens = sample.prompt_token_ids, sample.token_ids
        with torch.no_grad():
            before = old_model(torch.tensor([prompt + tokens[: switch - 1]]), use_cache=True)
            after = new_model(torch.tensor([tokens[switch - 1 : -1]]), cache=before.past_key_values)
        logits = torch.cat([before.logits[0, len(prompt) - 1 :], after.logits[0]]).float()
        swapped = selective_log_softmax(logits, torch.tensor(tokens), 1.0)[0]
        assert (torch.tensor(sample.logprobs) - swapped).abs().max().item() < 1e-4
        # A plain forward under either version is not what was sampled from.
        for reference in (old_model, new_model):
            forward = _teacher_forced(reference, prompt, tokens, 1.0)
            assert (torch.tensor(sample.logprobs) - forward).abs().max().item() > 1e-3


def test_bad_requests_fail_alone(qwen2, tokenizer):
    engine = LocalEngine(qwen2, tokenizer)
    plain_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>"
    )
    no_template = LocalEngine(qwen2, plain_tokenizer)
    good = InferenceRequest(prompt="the lazy dog", n=2, generation_args=GenerationArgs(max_tokens=12, seed=3))
    too_long = InferenceRequest(prompt="the fox " * 200)
    beyond = InferenceRequest(prompt="the fox", generation_args=GenerationArgs(max_tokens=CONTEXT))
    bad_stop = {"prompt": "the fox", "generation_args": {"stop": [7]}}
    unknown_field = {"prompt": "the fox", "generation_args": {"stop_sequences": ["x"]}}
    out_of_vocab = InferenceRequest(
        prompt="fox", generation_args=GenerationArgs(max_tokens=9, stop_token_ids=(10_000,))
    )
    bad_prefix = InferenceRequest(
        prompt="fox", prompt_token_ids=[5, 4000], generation_args=GenerationArgs(max_tokens=9)
    )

    async def scenario():
        results = await _gather(
            engine,
            [good, too_long, good, beyond, bad_stop, unknown_field, out_of_vocab, good, bad_prefix],
            return_exceptions=True,
        )
        chat = InferenceRequest(prompt=[ChatMessage(role="user", content="hi")])
        results.append(*(await _gather(no_template, [chat], return_exceptions=True)))
        return results

    results = asyncio.run(scenario())
    for index in (0, 2, 7):
        assert len(results[index]) == 2
        assert all(len(r.token_ids) == 12 or r.finish_reason == "stop" for r in results[index])
    failed = (1, 3, 4, 5, 6, 8, 9)
    assert all(isinstance(results[i], ValueError) for i in failed)
    messages = [str(results[i]) for i in failed]
    assert "prompt:" in messages[0] and f"context of {CONTEXT}" in messages[0]
    assert "max_tokens:" in messages[1]
    assert "stop" in messages[2] and "stop_sequences" in messages[3]
    assert "stop_token_ids" in messages[4] and "prompt_token_ids: [4000]" in messages[5]
    assert "chat template" in messages[6]
    assert results[0][0].token_ids == results[7][0].token_ids  # same seed, same tokens, errors or not
    with pytest.raises(ValueError, match="max_concurrent"):
        LocalEngine(qwen2, tokenizer, max_concurrent=0)


def test_failed_step_fails_its_batch_and_engine_recovers(tokenizer):
    model = _build("qwen2", len(tokenizer))
    engine = LocalEngine(model, tokenizer)
    decoder = engine._decoder
    real_decode = decoder.decode
    calls = {"n": 0}

    def flaky_decode(tokens):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real_decode(tokens)

    decoder.decode = flaky_decode
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(_long_request(20))
    (response,) = engine.generate(_long_request(20))
    assert len(response.token_ids) > 0


def test_stops(qwen2, tokenizer):
    engine = LocalEngine(qwen2, tokenizer, eos_token_ids=())
    greedy = GenerationArgs(temperature=0.0, max_tokens=60)
    (full,) = engine.generate(InferenceRequest(prompt="the quick", generation_args=greedy))
    assert full.finish_reason == "length" and len(full.token_ids) == 60

    # Stop token id: ends at its first occurrence, the token kept.
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    (by_id,) = engine.generate(
        InferenceRequest(
            prompt="the quick", generation_args=greedy.model_copy(update={"stop_token_ids": (stop_id,)})
        )
    )
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[: first + 1]

    # Stop string: text cut before it; token ids keep every sampled token up to the one completing it.
    stop = full.text[20:23]
    start = full.text.index(stop)
    (by_text,) = engine.generate(
        InferenceRequest(
            prompt="the quick", generation_args=greedy.model_copy(update={"stop": ("not there", stop)})
        )
    )
    assert by_text.finish_reason == "stop"
    assert by_text.text == full.text[:start]
    assert by_text.token_ids == full.token_ids[: len(by_text.token_ids)]
    assert stop in tokenizer.decode(by_text.token_ids) and stop not in tokenizer.decode(
        by_text.token_ids[:-1]
    )

    # Eos: with the default eos ids, <|im_end|> stops and is left out of the text.
    with_eos = LocalEngine(qwen2, tokenizer)
    eos = tokenizer.eos_token_id
    (response,) = with_eos.generate(
        InferenceRequest(
            prompt="the quick", generation_args=greedy.model_copy(update={"stop_token_ids": (stop_id,)})
        )
    )
    assert response.token_ids[-1] in (eos, stop_id)
    assert "<|im_end|>" not in response.text


def test_follow_up_turn_continues_prompt_token_ids(qwen2, tokenizer):
    engine = LocalEngine(qwen2, tokenizer)
    first_turn = [ChatMessage(role="user", content="12 + 35?")]
    args = GenerationArgs(temperature=0.0, max_tokens=8)
    (first,) = engine.generate(InferenceRequest(prompt=first_turn, generation_args=args))
    prefix = first.prompt_token_ids + first.token_ids + [tokenizer.eos_token_id]
    follow = [ChatMessage(role="user", content="and 1 + 1?")]
    (second,) = engine.generate(
        InferenceRequest(prompt=follow, prompt_token_ids=prefix, generation_args=args)
    )
    # The same ids as rendering the whole conversation with the template (the model's eos ends turn 1).
    conversation = (
        [m.model_dump() for m in first_turn]
        + [{"role": "assistant", "content": tokenizer.decode(first.token_ids)}]
        + [m.model_dump() for m in follow]
    )
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(second.prompt_token_ids) == rendered
    assert second.prompt_token_ids[: len(prefix)] == prefix
    (text_turn,) = engine.generate(
        InferenceRequest(prompt=" and", prompt_token_ids=[5, 6], generation_args=args)
    )
    assert text_turn.prompt_token_ids == [5, 6] + tokenizer(" and", add_special_tokens=False)["input_ids"]


def test_continuous_batching_short_requests_overtake_a_long_one(qwen2, tokenizer):
    engine = LocalEngine(qwen2, tokenizer, eos_token_ids=(), max_concurrent=3)
    finished: list[str] = []

    async def run(name: str, request: InferenceRequest):
        await engine.agenerate(request)
        finished.append(name)

    async def scenario():
        long = asyncio.ensure_future(run("long", _long_request(130)))
        await asyncio.sleep(0)
        shorts = [run(f"short{i}", _long_request(8, PROMPTS[i % 4])) for i in range(6)]
        await asyncio.gather(long, *shorts)

    asyncio.run(scenario())
    # Six short requests through the two other slots while the long one is still decoding.
    assert finished[-1] == "long" and len(finished) == 7
    assert engine.stats.steps < 130 + 6 * 8  # they shared decode steps with the long one


@pytest.mark.parametrize(("admit_at_least", "wait"), [(1 / 4, 16), (1.0, 3)])
def test_queued_requests_join_a_full_batch_in_bunches(qwen2, tokenizer, monkeypatch, admit_at_least, wait):
    # 8 rows; 20 one-row requests whose lengths differ, so rows leave one step at a time.
    monkeypatch.setattr(LocalEngine, "ADMIT_AT_LEAST", admit_at_least)
    monkeypatch.setattr(LocalEngine, "ADMISSION_WAIT", wait)
    engine = LocalEngine(qwen2, tokenizer, eos_token_ids=(), max_concurrent=8)
    admissions = []  # (requests admitted, requests still queued, steps so far) per prefill
    prefill = engine._decoder.prefill

    def recording_prefill(prompts, *args):
        admissions.append((len(prompts), engine._requests.queued, engine.stats.steps))
        return prefill(prompts, *args)

    monkeypatch.setattr(engine._decoder, "prefill", recording_prefill)
    lengths = [3 + (7 * i) % 20 for i in range(20)]

    async def scenario():
        return await asyncio.gather(
            *(engine.agenerate(_long_request(n, PROMPTS[i % 4])) for i, n in enumerate(lengths))
        )

    results = asyncio.run(scenario())
    assert [len(r[0].token_ids) for r in results] == lengths
    assert admissions[0][0] == 8
    joins_while_queued = [(count, steps) for count, queued, steps in admissions[1:] if queued]
    assert joins_while_queued
    if admit_at_least < 1:  # two rows (a quarter of 8) at a time while others queue
        assert all(count >= 2 for count, _ in joins_while_queued)
    else:  # never 8 free rows while others queue: bunches join after waiting `wait` steps
        gaps = [b - a for (_, a), (_, b) in itertools.pairwise(joins_while_queued)]
        assert all(gap >= wait + 1 for gap in gaps) and any(count < 8 for count, _ in joins_while_queued)
    assert len(admissions) < 1 + 12  # fewer prefills than one per request beyond the first eight


@pytest.mark.parametrize("prompt", [PROMPTS[3], LONG_PROMPT])  # copied into each row / shared
def test_group_prefills_prompt_once(qwen2, tokenizer, prompt):
    engine = LocalEngine(qwen2, tokenizer)
    request = InferenceRequest(prompt=prompt, n=8, generation_args=GenerationArgs(max_tokens=10, seed=0))
    responses = engine.generate(request)
    prompt_length = len(responses[0].prompt_token_ids)
    assert engine.stats.prefill_tokens == prompt_length
    assert len({tuple(r.token_ids) for r in responses}) == 8
    assert engine.stats.completion_tokens == sum(len(r.token_ids) for r in responses)
    # The first token of each sample comes from the prompt's logits; the others from decode steps.
    assert engine.stats.decode_tokens == engine.stats.completion_tokens - 8


def test_cancelled_request_leaves_the_batch(qwen2, tokenizer):
    engine = LocalEngine(qwen2, tokenizer, eos_token_ids=())

    async def scenario():
        doomed = asyncio.ensure_future(engine.agenerate(_long_request(150)))
        while engine.stats.completion_tokens < 5:
            await asyncio.sleep(0.001)
        doomed.cancel()
        (other,) = await engine.agenerate(_long_request(10))
        return other

    other = asyncio.run(scenario())
    assert len(other.token_ids) == 10
    deadline = time.monotonic() + 5
    while engine._requests.stepping and time.monotonic() < deadline:  # the driver ends once idle
        time.sleep(0.01)
    assert not engine._requests.stepping and engine.stats.completion_tokens < 150


def test_sync_generate_from_threads(qwen2, tokenizer):
    engine = LocalEngine(qwen2, tokenizer)
    request = InferenceRequest(prompt="fox", generation_args=GenerationArgs(max_tokens=15, seed=9))
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(engine.generate(request)[0].token_ids))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(r == results[0] for r in results)


# ---------------------------------------------------------------------------------------------
# Decoder: the compact cache against full forward passes


def _last_logits(model, sequences: list[list[int]]) -> torch.Tensor:
    """Next-token logits of each sequence from one right-padded forward pass (the reference)."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return logits[torch.arange(len(sequences)), mask.sum(1) - 1]


@pytest.mark.parametrize(
    ("family", "share_from"),
    [("qwen2", 0), ("qwen2", 10), ("qwen2", 10**9), ("llama", 0), ("llama", 10), ("gpt2", None)],
)
def test_decoder_logits_equal_full_forward_through_joins_and_removals(family, share_from):
    # share_from 0: every multi-sample group shares its prompt (cascade attention); 10**9: every
    # prompt is copied into its rows (one attention kernel); 10: both kinds in one batch, the
    # shared cache created before and after inline groups.
    model = _build(family, 97)
    decoder = build_decoder(model) if share_from is None else LlamaFamilyDecoder(model, share_from=share_from)
    assert isinstance(decoder, LlamaFamilyDecoder) == (family != "gpt2")
    generator = torch.Generator().manual_seed(0)
    sequences: list[list[int]] = []

    def join(lengths: list[int], copies: list[int]):
        prompts = [torch.randint(0, 97, (n,), generator=generator).tolist() for n in lengths]
        logits = decoder.prefill(prompts, copies)
        torch.testing.assert_close(logits, _last_logits(model, prompts), rtol=0, atol=1e-4)
        sequences.extend(list(p) for p, c in zip(prompts, copies, strict=True) for _ in range(c))

    def remove(rows: list[int]):
        nonlocal sequences
        order = decoder.remove_rows(rows)
        sequences = [sequences[i] for i in order]

    with torch.inference_mode():
        join([5, 3, 9], [2, 1, 3])  # with share_from=10 only the 9-token prompt (x3) is shared
        for step in range(14):
            tokens = torch.randint(0, 97, (decoder.num_rows,), generator=generator)
            for sequence, token in zip(sequences, tokens.tolist(), strict=True):
                sequence.append(token)
            logits = decoder.decode(tokens)
            if step in (0, 4, 7, 9, 13):
                torch.testing.assert_close(logits, _last_logits(model, sequences), rtol=0, atol=1e-4)
            if step in (3, 6):  # rows leave, whole groups among them (prompt 3 has one row)
                remove([0, 2, decoder.num_rows - 1])
            if step == 5:
                join([30, 3], [1, 4])  # inline groups; longer than the running rows: the cache grows
                # Leaving before any decode step (a first token that ends the sample): a new row
                # moves into an old row's slot.
                remove([1])
            if step == 8:
                remove(list(range(decoder.num_rows // 2)))
                join([12], [3])  # shared again with share_from=10, after inline groups
            if step == 10:
                join([1], [1])  # one prompt of one token in one row
        assert decoder.num_rows == len(sequences)
        decoder.reset()
        assert decoder.num_rows == 0


def test_row_cache_doubles_up_to_what_its_rows_can_reach():
    decoder = LlamaFamilyDecoder(_build("qwen2", 97, seed=3))
    lengths = []
    with torch.inference_mode():
        decoder.prefill([[5, 6, 7, 8, 9]], [2], max_new_tokens=[95])  # 5 + 95 positions at most
        for _ in range(94):
            decoder.decode(torch.tensor([11, 12]))
            lengths.append(decoder.cache.row_k.shape[3])
        assert sorted(set(lengths)) == [16, 32, 64, 112]  # 100 rounded up to a multiple of 16, not 128
        kept = decoder.cache.row_k
        decoder.reset()  # on CPU the next batch reuses the memory: nothing grows again
        decoder.prefill([[5, 6, 7]], [2], max_new_tokens=[90])
        for _ in range(90):
            decoder.decode(torch.tensor([11, 12]))
        assert decoder.cache.row_k is kept
        fresh = LlamaFamilyDecoder(decoder.model)
        fresh.prefill([[5, 6, 7, 8, 9]], [2])  # no limit given: plain doubling
        for _ in range(94):
            fresh.decode(torch.tensor([11, 12]))
        assert fresh.cache.row_k.shape[3] == 128


def test_reused_cache_gives_the_logits_of_a_fresh_one():
    # Rows of the next batch land on memory that earlier rows wrote: masked, it changes nothing.
    model = _build("qwen2", 97, seed=3)
    decoder = LlamaFamilyDecoder(model)
    prompts, tokens = [[5, 6, 7, 8], [9, 10]], torch.tensor([11, 12, 13])
    with torch.inference_mode():
        decoder.prefill([list(range(20, 60))], [4])
        for _ in range(8):
            decoder.decode(torch.tensor([14, 15, 16, 17]))
        decoder.reset()
        assert decoder.num_rows == 0 and decoder.cache_bytes > 0
        decoder.prefill(prompts, [2, 1])
        reused = decoder.decode(tokens)
        fresh = LlamaFamilyDecoder(model)
        fresh.prefill(prompts, [2, 1])
        torch.testing.assert_close(reused, fresh.decode(tokens), rtol=0, atol=1e-6)
