"""Router replay (`llmrl.models.routing`) on small random Qwen3-MoE and Mixtral models: recorded routes
are the routers' selections; replaying them reproduces a forward bitwise, keeps a forward on the
recorded experts when the gate has moved, and still lets the router learn; disagreement is counted."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
import transformers
from test_model_families import build_config, word_tokenizer

from llmrl.config import ConfigError, TrainingConfig, config_from_dict
from llmrl.errors import ModelSpecError
from llmrl.inference.engine import LocalEngine
from llmrl.models.loading import enable_activation_checkpointing
from llmrl.models.routing import RouteRecorder, RouteReplay, moe_routers, routes_for, routes_from_wire
from llmrl.trainer import Trainer
from llmrl.trainer.passes import ForwardPasses
from llmrl.types import GenerationArgs, InferenceRequest

FAMILIES = ["qwen3_moe", "mixtral"]


def build_model(family: str, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(build_config(family)).to(dtype).eval()


def batch(rows: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(2, 200, (rows, length), generator=torch.Generator().manual_seed(1))


def recorded(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the forward's logits, its routes ``[tokens, layers, k]``)."""
    with torch.no_grad(), RouteRecorder(model) as recorder:
        logits = model(input_ids=ids).logits
    return logits, recorder.take()


def logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_routes_are_the_routers_top_k(family):
    model = build_model(family)
    ids = batch()
    _, routes = recorded(model, ids)
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    assert routes.shape == (ids.numel(), 2, 2) and routes.dtype == torch.int16
    for layer, router_logits in enumerate(out.router_logits):
        top = torch.topk(torch.softmax(router_logits.float(), -1), 2, dim=-1).indices
        assert torch.equal(routes[:, layer].long(), top)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_a_forwards_own_routes_is_that_forward_bitwise(family, dtype):
    model = build_model(family, dtype)
    ids = batch()
    logits, routes = recorded(model, ids)
    replay = RouteReplay(model)
    with torch.no_grad(), replay.routes(routes, replay=True):
        again = model(input_ids=ids).logits
    assert torch.equal(again, logits)
    assert replay.pop_counts().shares() == {
        "routing/differs_any_layer": 0.0,
        "routing/differs_layer_0": 0.0,
        "routing/differs_layer_1": 0.0,
    }
    assert replay.pop_counts().shares() == {}


def moved_gate(model, scale: float = 0.02) -> None:
    """Noise on every router's weights, as if the trainer's gate differed from the sampler's."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(
                scale * torch.randn(router.weight.shape, generator=generator).to(router.weight.dtype)
            )


@pytest.mark.parametrize("family", FAMILIES)
def test_with_a_moved_gate_replay_keeps_the_recorded_experts(family):
    model = build_model(family)
    ids = batch()
    sampled, routes = recorded(model, ids)
    moved_gate(model)
    replay = RouteReplay(model)
    with torch.no_grad(), replay.routes(routes, replay=False):
        live = model(input_ids=ids).logits
    observed = replay.pop_counts().shares()
    assert observed["routing/differs_any_layer"] > 0.1, observed
    with torch.no_grad(), replay.routes(routes, replay=True), RouteRecorder(model) as used:
        replayed = model(input_ids=ids).logits
    assert torch.equal(used.take(), routes)  # the experts the forward ran are the recorded ones
    assert replay.pop_counts().shares() == observed  # the live top k differs as much either way
    live_gap = (logprobs(live, ids) - logprobs(sampled, ids)).abs().max()
    replay_gap = (logprobs(replayed, ids) - logprobs(sampled, ids)).abs().max()
    # The gating weights still follow the moved gate; the experts no longer do (measured: 0.39 against
    # 1.04 nats for Qwen3-MoE, 0.25 against 0.73 for Mixtral).
    assert replay_gap < live_gap / 2, (replay_gap, live_gap)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_router_still_learns_under_replay(family):
    model = build_model(family).train()
    ids = batch()
    _, routes = recorded(model, ids)
    with RouteReplay(model).routes(routes, replay=True):
        loss = -logprobs(model(input_ids=ids).logits, ids).mean()
    loss.backward()
    for router in moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_unrecorded_tokens_route_live_and_are_not_counted():
    model = build_model("mixtral")
    ids = batch()
    logits, routes = recorded(model, ids)
    moved_gate(model)
    with torch.no_grad():
        live = model(input_ids=ids).logits
    none = torch.full_like(routes, -1)
    replay = RouteReplay(model)
    with torch.no_grad(), replay.routes(none, replay=True):
        assert torch.equal(model(input_ids=ids).logits, live)
    assert replay.pop_counts().shares() == {}


def test_activation_checkpointing_replays_and_counts_once():
    model = build_model("qwen3_moe")
    ids = batch()
    _, routes = recorded(model, ids)
    moved_gate(model)
    plain = RouteReplay(model)
    with torch.no_grad(), plain.routes(routes, replay=True):
        expected = model(input_ids=ids).logits
    model.train()
    enable_activation_checkpointing(model)  # as the trainer does
    checkpointed = RouteReplay(model)
    with checkpointed.routes(routes, replay=True):
        out = model(input_ids=ids).logits
        out.float().sum().backward()  # the recomputation calls every router again
    torch.testing.assert_close(out, expected)
    assert checkpointed.pop_counts().shares() == plain.pop_counts().shares()


def test_routes_of_another_shape_or_model_are_refused():
    model = build_model("qwen3_moe")
    ids = batch()
    _, routes = recorded(model, ids)
    with pytest.raises(ValueError, match=r"this model needs \[tokens, 2, 2\]"):
        with RouteReplay(model).routes(routes[:, :1], replay=True):
            pass
    with pytest.raises(ValueError, match="routes for 12 tokens; the forward routes 24 at MoE layer 0"):
        with torch.no_grad(), RouteReplay(model).routes(routes[:12], replay=True):
            model(input_ids=ids)


def test_a_dense_model_or_another_gating_is_refused():
    dense = transformers.AutoModelForCausalLM.from_config(build_config("qwen3"))
    with pytest.raises(ModelSpecError, match="Qwen3ForCausalLM has no mixture-of-experts layers"):
        RouteReplay(dense)

    class SigmoidTopKRouter(torch.nn.Module):
        top_k = 2

    with pytest.raises(
        ModelSpecError, match="SigmoidTopKRouter gates otherwise than a softmax over all experts"
    ):
        moe_routers(torch.nn.Sequential(SigmoidTopKRouter()))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_records_the_routes_of_every_token_it_read(family):
    model = build_model(family)
    engine = LocalEngine(copy.deepcopy(model), word_tokenizer(), record_routes=True, seed=0)
    prompt = "t5 t17 t9 t40 t3"
    requests = [
        InferenceRequest(prompt=prompt, generation_args=GenerationArgs(max_tokens=6, temperature=1.0), n=3),
        InferenceRequest(prompt="t8 t8", generation_args=GenerationArgs(max_tokens=4, temperature=0.0)),
    ]

    async def both():
        return await asyncio.gather(*(engine.agenerate(r) for r in requests))

    responses = [r for answer in asyncio.run(both()) for r in answer]
    for response in responses:
        ids = response.prompt_token_ids + response.token_ids
        routes = routes_from_wire(response.routed_experts)
        assert routes.shape == (len(ids) - 1, 2, 2)
        _, expected = recorded(model, torch.tensor([ids[:-1]]))  # one forward of what the engine read
        assert torch.equal(routes, expected)


def test_an_engine_of_a_dense_model_records_no_routes():
    dense = transformers.AutoModelForCausalLM.from_config(build_config("qwen3"))
    with pytest.raises(ModelSpecError, match="no mixture-of-experts layers"):
        LocalEngine(dense, word_tokenizer(), record_routes=True)
    (response,) = LocalEngine(build_model("mixtral"), word_tokenizer()).generate(
        InferenceRequest(prompt="t3 t4", generation_args=GenerationArgs(max_tokens=2))
    )
    assert response.routed_experts is None


def engine_sequences(model, family_seed: int = 0):
    """Sequences the recording engine sampled from `model`: two prompts, several samples each."""
    engine = LocalEngine(copy.deepcopy(model), word_tokenizer(), record_routes=True, seed=family_seed)
    args = GenerationArgs(max_tokens=6, temperature=1.0)
    responses = [
        *engine.generate(InferenceRequest(prompt="t5 t17 t9 t40 t3", generation_args=args, n=3)),
        *engine.generate(InferenceRequest(prompt="t8 t30 t2", generation_args=args, n=2)),
    ]
    sequences = [r.prompt_token_ids + r.token_ids for r in responses]
    masks = [[False] * len(r.prompt_token_ids) + [True] * len(r.token_ids) for r in responses]
    return responses, sequences, masks


def replayed_one_by_one(model, responses, sequences, masks) -> list[torch.Tensor]:
    """Each sequence's completion logprobs in a forward of its own under its recorded routes."""
    out = []
    for response, ids, mask in zip(responses, sequences, masks, strict=True):
        routes = routes_for(routes_from_wire(response.routed_experts), len(ids), 2, 2)
        with torch.no_grad(), RouteReplay(model).routes(routes, replay=True):
            logits = model(input_ids=torch.tensor([ids])).logits
        out.append(logprobs(logits, torch.tensor([ids]))[0][torch.tensor(mask[1:])])
    return out


@pytest.mark.parametrize("share_prefixes", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_passes_replay_each_sequences_own_routes(family, share_prefixes):
    model = build_model(family)
    responses, sequences, masks = engine_sequences(model)
    moved_gate(model)
    training = TrainingConfig(router_replay=True, share_prefixes=share_prefixes, micro_batch_tokens=64)
    passes = ForwardPasses(model, training, pad_token_id=0)
    passes.follow_routes([r.routed_experts for r in responses])
    packed = passes.sequence_logprobs(model, sequences, masks, range(len(sequences)))
    expected = replayed_one_by_one(model, responses, sequences, masks)
    for got, want, mask in zip(packed, expected, masks, strict=True):
        torch.testing.assert_close(got[torch.tensor(mask)], want, atol=1e-5, rtol=0)
    assert passes.route_metrics()["routing/differs_any_layer"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_brings_the_trainers_logprobs_back_to_the_engines(family):
    """The engine sampled; then the trainer's gate moved (as if sampling lagged a step behind)."""
    model = build_model(family)
    responses, sequences, masks = engine_sequences(model)
    moved_gate(model)
    gaps = {}
    for mode in ("observe", True):
        passes = ForwardPasses(model, TrainingConfig(router_replay=mode), pad_token_id=0)
        passes.follow_routes([r.routed_experts for r in responses])
        trained = passes.sequence_logprobs(model, sequences, masks, range(len(sequences)))
        gaps[mode] = max(
            (got[torch.tensor(mask)] - torch.tensor(r.logprobs)).abs().max().item()
            for got, mask, r in zip(trained, masks, responses, strict=True)
        )
        assert passes.route_metrics()["routing/differs_any_layer"] > 0  # the same either way
    assert gaps[True] < 0.75 * gaps["observe"], gaps  # measured: about half


def test_a_run_config_asks_the_engine_for_routes_and_refuses_other_inference():
    base = {
        "model": {"spec": "tiny://arithmetic-moe"},
        "environments": [{"agent_type": "arithmetic"}],
        "training": {"router_replay": True},
    }
    assert config_from_dict(base).inference_for_run().record_routes
    assert not config_from_dict({**base, "training": {}}).inference_for_run().record_routes
    with pytest.raises(ConfigError, match="training.router_replay: inference.type 'openai' does not return"):
        config_from_dict({**base, "inference": {"type": "openai", "base_url": "http://127.0.0.1:9/v1"}})


def test_router_replay_on_a_dense_model_is_refused_at_the_start(tmp_path):
    config = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "model": {"spec": "tiny://arithmetic"},
            "environments": [{"agent_type": "arithmetic"}],
            "training": {"router_replay": "observe"},
        }
    )
    with pytest.raises(
        ConfigError, match="training.router_replay: tiny://arithmetic: Qwen2ForCausalLM has no mixture"
    ):
        Trainer(config)


def test_a_model_of_another_moe_shape_beside_the_policy_routes_live():
    """A distillation teacher that is an MoE of other layers or top k: the policy's routes do not
    describe it, so its passes route live (and are not counted)."""
    model = build_model("qwen3_moe")
    responses, sequences, masks = engine_sequences(model)
    other = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3MoeConfig(**{**build_config("qwen3_moe").to_dict(), "num_experts_per_tok": 1})
    ).eval()
    passes = ForwardPasses(model, TrainingConfig(router_replay=True), pad_token_id=0)
    passes.follow_routes([r.routed_experts for r in responses])
    plain = ForwardPasses(model, TrainingConfig(), pad_token_id=0)
    got = passes.sequence_logprobs(other, sequences, masks, range(len(sequences)))
    want = plain.sequence_logprobs(other, sequences, masks, range(len(sequences)))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
