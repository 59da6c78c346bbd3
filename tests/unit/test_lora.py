"""LoRA (`model.lora`): the config, adapters over a frozen base, adapter-only syncs to the embedded
engine and llmrl's server (merged onto the base, checked), PEFT's files, and the memory plan."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from llmrl.config import ConfigError, LoraConfig, load_config
from llmrl.inference.decoder import HFDecoder
from llmrl.inference.engine import LocalEngine
from llmrl.models import load_model
from llmrl.server.inference_server import create_inference_app
from llmrl.trainer.lora import Adapters, adapter_sizes
from llmrl.trainer.memory import LoraSizes
from llmrl.types import GenerationArgs, InferenceRequest
from llmrl.weights import AdapterWeights, read_adapter
from tests.unit.test_memory_plan import meta_model, settings

PROMPT = "12 + 35 ="


def trained_adapters(tiny_model, lora: LoraConfig, seed: int = 0) -> Adapters:
    """Adapters over a copy of the tiny model with random B (as after training: the policy is not the base)."""
    torch.manual_seed(seed)
    adapters = Adapters(copy.deepcopy(tiny_model[0]), lora)
    with torch.no_grad():
        for name, parameter in adapters.peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    return adapters


def completion_logprobs(model: torch.nn.Module, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """The logprobs `model` gives each completion token (what the trainer computes)."""
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def sampled(engine: LocalEngine, seed: int = 1):
    args = GenerationArgs(temperature=1.0, max_tokens=6, seed=seed)
    return engine.generate(InferenceRequest(prompt=PROMPT, generation_args=args, n=4))


def assert_engine_serves(engine: LocalEngine, model: torch.nn.Module, version: int) -> None:
    for response in sampled(engine):
        assert response.policy_version == version
        expected = completion_logprobs(model, response.prompt_token_ids, response.token_ids)
        assert torch.allclose(torch.tensor(response.logprobs), expected, atol=1e-4), (
            response.logprobs,
            expected,
        )


# -- config --------------------------------------------------------------------------------------


def test_lora_is_off_unless_configured_and_its_errors_name_the_field():
    assert load_config().model.lora is None
    assert load_config(None, ["model.lora={}"]).model.lora == LoraConfig()
    for override, words in (
        ("model.lora={rank: 0}", "model.lora.rank"),
        ("model.lora={target_modules: []}", "model.lora.target_modules"),
        ("model.lora={dropout: 1.0}", "model.lora.dropout"),
        ("model.lora={ranks: 8}", "model.lora.ranks"),
    ):
        with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
            load_config(None, [override])


# -- the adapters --------------------------------------------------------------------------------


def test_only_float32_adapters_train_over_a_frozen_base_in_the_compute_dtype(tiny_model):
    base = copy.deepcopy(tiny_model[0]).to(torch.bfloat16)
    adapters = Adapters(base, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    trainable = {n: p for n, p in adapters.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    frozen = [p for p in adapters.model.parameters() if not p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in frozen)
    count = sum(p.numel() for p in trainable.values())
    config = tiny_model[0].config
    q, v = config.hidden_size, config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    assert count == config.num_hidden_layers * 4 * (2 * config.hidden_size + q + v)  # r * (in + out) each
    meta, _ = load_model("tiny://arithmetic", device="meta")
    q_and_v = config.num_hidden_layers * config.hidden_size * (q + v)
    assert adapter_sizes(meta, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])) == (count, q_and_v)
    assert adapters.summary().startswith(f"LoRA: {count:,} of {count + sum(p.numel() for p in frozen):,}")


def test_the_reference_is_the_base_with_the_adapters_off(tiny_model):
    adapters = trained_adapters(tiny_model, LoraConfig(rank=4))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        with adapters.disabled():
            reference = adapters.model(input_ids=ids).logits
        policy = adapters.model(input_ids=ids).logits
        base = tiny_model[0](input_ids=ids).logits
    assert torch.equal(reference, base) and not torch.allclose(policy, base, atol=1e-3)


# -- syncs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "down_proj"]])
def test_an_adapter_sync_serves_the_trainers_policy_and_replaces_the_previous_version(tiny_model, targets):
    model, tokenizer = tiny_model
    engine = LocalEngine(copy.deepcopy(model), tokenizer, owns_model=True)
    assert engine.uses_fast_path  # fused q/k/v and gate/up rows
    first = trained_adapters(tiny_model, LoraConfig(rank=8, target_modules=targets), seed=1)
    engine.update_weights(first.weights(), version=1)
    assert_engine_serves(engine, first.model, 1)
    second = trained_adapters(tiny_model, LoraConfig(rank=8, target_modules=targets), seed=2)
    engine.update_weights(second.weights(), version=2)
    assert_engine_serves(engine, second.model, 2)  # merged onto the base, not onto version 1


def test_the_generic_decoder_merges_adapters_too(tiny_model):
    model, tokenizer = tiny_model
    engine = LocalEngine(copy.deepcopy(model), tokenizer)
    engine._decoder = HFDecoder(engine.model)
    adapters = trained_adapters(tiny_model, LoraConfig(rank=4))
    engine.update_weights(adapters.weights(), version=3)
    assert_engine_serves(engine, adapters.model, 3)


def test_adapters_that_do_not_fit_are_refused_and_the_old_weights_serve(tiny_model):
    model, tokenizer = tiny_model
    engine = LocalEngine(copy.deepcopy(model), tokenizer, owns_model=True)
    good = trained_adapters(tiny_model, LoraConfig(rank=4)).weights()
    name = next(n for n in good.tensors if "lora_B" in n)
    wrong_shape = {**good.tensors, name: torch.zeros(3, 4)}
    not_finite = {**good.tensors, name: torch.full_like(good.tensors[name], float("nan"))}
    stray = {**good.tensors, "base_model.model.model.norm.weight": torch.ones(4)}
    before = sampled(engine)
    for tensors, words in ((wrong_shape, "shape"), (not_finite, "non-finite"), (stray, "not lora_A/lora_B")):
        with pytest.raises(ValueError, match=words):
            engine.update_weights(AdapterWeights(tensors, good.config), version=1)
    assert engine.policy_version == 0
    assert [r.token_ids for r in sampled(engine)] == [r.token_ids for r in before]


def test_the_adapter_is_peft_s_folder_and_peft_loads_it(tiny_model, tmp_path):
    from peft import PeftModel

    adapters = trained_adapters(tiny_model, LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "o_proj"]))
    adapters.save(tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    loaded = PeftModel.from_pretrained(copy.deepcopy(tiny_model[0]), str(tmp_path / "adapter"))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, adapters.model(input_ids=ids).logits)
    again = read_adapter(tmp_path / "adapter")
    assert again is not None and again.config == adapters.config()
    assert all(torch.equal(again.tensors[n], t) for n, t in adapters.weights().tensors.items())


def test_llmrl_s_server_takes_adapters_streamed_or_from_its_folder(tiny_model, tmp_path):
    from llmrl.weights.llmrl_server import LlmrlServerTransport

    model, tokenizer = tiny_model
    engine = LocalEngine(copy.deepcopy(model), tokenizer, owns_model=True)
    folder = tmp_path / "weights"
    folder.mkdir()
    app = create_inference_app(engine, model_name="tiny", api_key="k", weights_dir=folder)
    with TestClient(app, headers={"Authorization": "Bearer k"}, raise_server_exceptions=False) as client:

        async def post(path: str, **request):
            # the transport streams a file as an async body, which the synchronous test client cannot send
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://server", headers=client.headers
            ) as http:
                answer = await http.post(f"/v1{path}", **request)
            assert answer.status_code == 200, answer.text
            return answer.json()

        def run(coroutine):
            asyncio.run(coroutine)

        for version, weights_dir in ((1, None), (2, folder)):
            adapters = trained_adapters(tiny_model, LoraConfig(rank=4), seed=version)
            LlmrlServerTransport(post, run, weights_dir).send(adapters.weights(), version)
            assert_engine_serves(engine, adapters.model, version)
        bad = trained_adapters(tiny_model, LoraConfig(rank=4)).weights()
        name = next(n for n in bad.tensors if "lora_A" in n)
        tensors = {**bad.tensors, name: torch.full_like(bad.tensors[name], float("inf"))}
        octets = {"Authorization": "Bearer k", "Content-Type": "application/octet-stream"}
        answer = client.post(
            "/v1/weights?version=3", content=save(tensors, bad.file_metadata()), headers=octets
        )
        assert answer.status_code == 400 and "non-finite" in answer.json()["error"]["message"]
        assert engine.policy_version == 2


# -- memory --------------------------------------------------------------------------------------


def test_the_memory_plan_of_lora_has_no_reference_and_adapter_sized_optimizer_state():
    from llmrl.trainer.memory import plan_memory

    lora = LoraSizes(adapter=10_000, adapted=50_000)
    full = plan_memory(meta_model(), settings(reference_model=True), "cpu")
    plan = plan_memory(meta_model(), settings(lora=lora), "cpu")
    terms, full_terms = plan.terms(rank0=True), full.terms(rank0=True)
    parameters = plan.shape.parameters
    assert terms["parameters"] == parameters * 2 + 10_000 * 4  # a bf16 base, float32 adapters
    assert (
        terms["gradients"] == 10_000 * 4 and terms["optimizer"] == 3 * 10_000 * 4
    )  # moments, step temporary
    assert "reference" not in terms and "gathered" not in terms and "reference" in full_terms
    assert terms["engine"] == full_terms["engine"] + 50_000 * 2  # the base copy adapters merge onto
    assert plan.total() < full.total()
