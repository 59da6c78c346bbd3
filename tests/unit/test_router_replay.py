"""Router replay (`llmrl.models.routing`) on small random Qwen3-MoE and Mixtral models: recorded routes
are the routers' selections; replaying them reproduces a forward bitwise, keeps a forward on the
recorded experts when the gate has moved, and still lets the router learn; disagreement is counted."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_model_families import build_config

from llmrl.errors import ModelSpecError
from llmrl.models.loading import enable_activation_checkpointing
from llmrl.models.routing import RouteRecorder, RouteReplay, moe_routers

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
    assert replay.pop_metrics() == {
        "routing/differs_any_layer": 0.0,
        "routing/differs_layer_0": 0.0,
        "routing/differs_layer_1": 0.0,
    }
    assert replay.pop_metrics() == {}


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
    observed = replay.pop_metrics()
    assert observed["routing/differs_any_layer"] > 0.1, observed
    with torch.no_grad(), replay.routes(routes, replay=True), RouteRecorder(model) as used:
        replayed = model(input_ids=ids).logits
    assert torch.equal(used.take(), routes)  # the experts the forward ran are the recorded ones
    assert replay.pop_metrics() == observed  # the live top k differs as much either way
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
    assert replay.pop_metrics() == {}


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
    assert checkpointed.pop_metrics() == plain.pop_metrics()


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
