"""`llmrl serve-tinker` driven by the official `tinker` SDK over HTTP, on the tiny model (docs/tinker.md)."""

from __future__ import annotations

import copy
import re
import sys
import time

import httpx
import pytest
import tinker
import torch
from test_server_robustness import served
from tinker import types

from llmrl.algorithms.logprobs import selective_log_softmax
from llmrl.cli import EXIT_USAGE, build_parser, main
from llmrl.server.tinker import TinkerService, create_tinker_app

BASE = "tiny://arithmetic"
TEXTS = ["12+34=46", "7+8=15", "50+25=75", "9+90=99"]


@pytest.fixture(scope="module")
def tinker_service(tmp_path_factory):
    storage = tmp_path_factory.mktemp("tinker_storage")
    service = TinkerService(base_specs=[BASE], lora_rank_max=32, device="cpu", storage=storage, seed=0)
    service.load_base(BASE)
    yield service
    service.close()


@pytest.fixture(scope="module")
def base_url(monkeypatch_module, tinker_service):
    monkeypatch_module.setenv("TINKER_TELEMETRY", "0")
    with served(create_tinker_app(tinker_service)) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def service_client(base_url):
    client = tinker.ServiceClient(base_url=base_url, api_key="tml-local")
    yield client
    client.close("success").result(timeout=30)


def sft_data(tokenizer) -> list[types.Datum]:
    """Each text as one datum: inputs its tokens but the last, targets the next tokens, weight 1."""
    data = []
    for text in TEXTS:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
            )
        )
    return data


def training_client(service_client, **lora):
    return service_client.create_lora_training_client(
        base_model=BASE, rank=8, seed=0, train_unembed=False, **lora
    ).result(timeout=60)


def test_capabilities_and_info(base_url, service_client):
    models = (
        tinker.RestClient(base_url=base_url, api_key="tml-local")
        .get_server_capabilities()
        .result(timeout=30)
        .supported_models
    )
    assert [m.model_name for m in models] == [BASE]
    client = training_client(service_client)
    info = client.get_info()
    assert (info.model_data.model_name, info.lora_rank, info.is_lora) == (BASE, 8, True)


def test_first_loss_is_llmrl_cross_entropy_of_the_base(service_client, tiny_model):
    """A new adapter (B = 0) is the base model: the first loss is the base's weighted cross-entropy."""
    model, tokenizer = tiny_model
    data = sft_data(tokenizer)
    data[0].loss_fn_inputs["weights"] = types.TensorData.from_numpy(
        torch.linspace(0.0, 1.0, len(data[0].loss_fn_inputs["weights"].data)).numpy()
    )
    client = training_client(service_client)
    output = client.forward_backward(data, "cross_entropy").result(timeout=60)

    expected_loss = 0.0
    for datum, returned in zip(data, output.loss_fn_outputs, strict=True):
        tokens = datum.model_input.to_ints()
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
        weights = torch.tensor(datum.loss_fn_inputs["weights"].data)
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0]
        expected, _ = selective_log_softmax(logits, targets)
        torch.testing.assert_close(torch.tensor(returned["logprobs"].data), expected, atol=1e-5, rtol=1e-5)
        expected_loss += float(-(weights * expected).sum())
    assert output.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)


def test_sft_loop_lowers_the_loss_and_sampling_serves_the_adapter(service_client, tiny_model):
    model, tokenizer = tiny_model
    data = sft_data(tokenizer)
    client = training_client(service_client)
    losses = []
    for _ in range(8):
        backward = client.forward_backward(data, "cross_entropy")
        step = client.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(backward.result(timeout=60).metrics["loss:sum"])
        step.result(timeout=60)
    assert losses[-1] < 0.5 * losses[0], losses

    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    prompt = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    result = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result(timeout=60)
    assert [len(s.tokens) for s in result.sequences] == [4, 4]
    assert {s.stop_reason for s in result.sequences} == {"length"}
    sampled = result.sequences[0]

    # The sampler's logprobs are the trained adapter's (its forward on the same tokens), not the base's.
    tokens = prompt + sampled.tokens
    scored = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)},
    )
    adapter = client.forward([scored], "cross_entropy").result(timeout=60)
    adapter_logprobs = torch.tensor(adapter.loss_fn_outputs[0]["logprobs"].data[-4:])
    torch.testing.assert_close(torch.tensor(sampled.logprobs), adapter_logprobs, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0, -4:]
    base_logprobs, _ = selective_log_softmax(logits, torch.tensor(sampled.tokens))
    assert (adapter_logprobs - base_logprobs).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("inputs", "loss_fn_inputs", "message"),
    [
        (
            lambda t: t[:-1],
            lambda t: {"target_tokens": t[1:], "weights": [1.0] * (len(t) - 2)},
            r"data\[0\]\.loss_fn_inputs\.weights: shape \[\d+\] for \d+ input tokens \(one per input token\)$",
        ),
        (
            lambda t: t[:-1],
            lambda t: {"target_tokens": t[1:]},
            r"data\[0\]\.loss_fn_inputs\.weights: required by cross_entropy$",
        ),
        (
            lambda t: [5000, *t[1:-1]],
            lambda t: {"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)},
            r"data\[0\]\.model_input: token 5000 is outside the vocabulary \(0\.\.1023\)$",
        ),
        (
            lambda t: t[:-1],
            lambda t: {"target_tokens": t[:-1], "weights": [1.0] * (len(t) - 1)},
            r"data\[0\]\.loss_fn_inputs\.target_tokens: must be model_input shifted by one",
        ),
        (
            lambda t: t[:1] * 1100,
            lambda t: {"target_tokens": t[:1] * 1100, "weights": [1.0] * 1100},
            r"data\[0\]\.model_input: 1100 tokens; the model takes at most 1023 here$",
        ),
    ],
    ids=[
        "weights one short",
        "no weights",
        "token outside the vocabulary",
        "targets not shifted",
        "too long",
    ],
)
def test_malformed_datum_is_refused_naming_the_field(
    service_client, tiny_model, inputs, loss_fn_inputs, message
):
    _, tokenizer = tiny_model
    tokens = tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(inputs(tokens)), loss_fn_inputs=loss_fn_inputs(tokens)
    )
    client = training_client(service_client)
    with pytest.raises(tinker.BadRequestError) as refused:
        client.forward_backward([datum], "cross_entropy").result(timeout=60)
    assert refused.value.status_code == 400
    (line,) = refused.value.body["error"]["message"].splitlines()
    assert re.search(message, line), line


def test_unknown_loss_and_unbuilt_calls_are_refused_in_one_line(base_url, service_client, tiny_model):
    _, tokenizer = tiny_model
    client = training_client(service_client)
    with pytest.raises(tinker.BadRequestError, match="loss_fn: 'gspo': not served yet"):
        client.forward_backward(sft_data(tokenizer), "gspo").result(timeout=60)
    answer = httpx.post(f"{base_url}/api/v1/copy_weights", json={"model_id": client.model_id})
    assert answer.status_code == 404
    message = answer.json()["error"]["message"]
    assert message == "RestClient.copy_weights (/api/v1/copy_weights) is not served yet by llmrl serve-tinker"


def test_bad_rank_and_unknown_model_are_refused(service_client):
    with pytest.raises(tinker.BadRequestError, match=r"lora_config\.rank: must be in 1\.\.32, got 64"):
        service_client.create_lora_training_client(base_model=BASE, rank=64).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="base_model: 'Qwen/Qwen3-8B' is not served here"):
        service_client.create_lora_training_client(base_model="Qwen/Qwen3-8B").result(timeout=60)


def test_default_lora_switches_train_and_sample(service_client, tiny_model):
    """The SDK's defaults adapt the head too (train_unembed), which the tiny model ties to its embedding."""
    _, tokenizer = tiny_model
    client = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result(timeout=60)
    client.forward_backward(sft_data(tokenizer), "cross_entropy").result(timeout=60)
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    prompt = types.ModelInput.from_ints(tokenizer("7+8=", add_special_tokens=False)["input_ids"])
    result = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3, seed=5)).result(timeout=60)
    assert 1 <= len(result.sequences[0].tokens) <= 3


def test_cli_parses_serve_tinker():
    args = build_parser().parse_args(
        ["serve-tinker", "--model", BASE, "--model", "./other", "--port", "9000", "--lora-rank-max", "16"]
    )
    assert (args.model, args.port, args.lora_rank_max, args.host) == (
        [BASE, "./other"],
        9000,
        16,
        "127.0.0.1",
    )


def test_head_adapter_merged_for_sampling_leaves_the_input_embedding_alone(tmp_path):
    service = TinkerService(base_specs=[BASE], lora_rank_max=8, device="cpu", storage=tmp_path)
    service.sessions.add("s")
    request = types.CreateModelRequest(
        session_id="s", model_seq_id=0, base_model=BASE, lora_config=types.LoraConfig(rank=2)
    )
    trained = service.models[service.create_model(request).model_id]
    head = trained.peft_model.get_base_model().lm_head
    torch.nn.init.normal_(head.lora_B["default"].weight)
    merged = trained.peft_model.merge_and_unload()
    base_embedding = service.load_base(BASE)[0].get_input_embeddings().weight
    torch.testing.assert_close(merged.get_input_embeddings().weight, base_embedding)
    assert not torch.allclose(merged.lm_head.weight, base_embedding)


def test_serve_tinker_without_the_sdk_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tinker", None)
    for name in [m for m in sys.modules if m.startswith("llmrl.server.tinker")]:
        monkeypatch.delitem(sys.modules, name)
    assert main(["serve-tinker", "--model", BASE]) == EXIT_USAGE
    assert "serve-tinker needs the tinker SDK: bash scripts/setup.sh tinker" in capsys.readouterr().err


def rl_data(tokenizer) -> list[types.Datum]:
    """Policy-gradient data as a Tinker RL loop builds it: sampler logprobs away from the model's (so
    that ratios leave the clip range both ways), advantages on the completion only, and for the second
    datum a 0/1 weights mask that leaves out its last token."""
    generator = torch.Generator().manual_seed(7)
    data = []
    for i, text in enumerate(TEXTS[:3]):
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        n = len(tokens) - 1
        completion = torch.arange(n) >= n // 2
        inputs = {
            "target_tokens": tokens[1:],
            "logprobs": (-2.0 + 0.6 * torch.randn(n, generator=generator)).tolist(),
            "advantages": torch.where(completion, torch.randn(n, generator=generator), 0.0).tolist(),
        }
        if i == 1:
            inputs["weights"] = [1.0] * (n - 1) + [0.0]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return data


def documented_loss(name, config, logprobs, datum):
    """Tinker's documented formula for one datum (``logprobs`` carries the gradient)."""
    inputs = datum.loss_fn_inputs
    sampled = torch.tensor(inputs["logprobs"].data)
    advantages = torch.tensor(inputs["advantages"].data)
    mask = torch.tensor(inputs["weights"].data) if "weights" in inputs else torch.ones_like(sampled)
    ratio = torch.exp(logprobs - sampled)
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if name == "importance_sampling":
        objective = ratio * advantages
    elif name == "ppo":
        objective = torch.min(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    elif name == "cispo":
        objective = torch.clamp(ratio, low, high).detach() * logprobs * advantages
    else:
        objective = logprobs * advantages - 0.5 * config["beta"] * (logprobs - sampled) ** 2
    return -(mask * objective).sum()


def assert_same_gradients(served: dict, reference: dict) -> None:
    """The served adapter's gradients equal the reference's, up to the float32 noise of a packed forward
    (which grows with the gradient's size)."""
    assert reference
    for name, parameter in reference.items():
        scale = float(parameter.grad.abs().max())
        torch.testing.assert_close(served[name].grad, parameter.grad, atol=1e-4 * scale, rtol=1e-3)


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("importance_sampling", {}),
        ("ppo", {}),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
        ("cispo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.1}),
        ("dro", {"beta": 0.5}),
    ],
    ids=["importance_sampling", "ppo", "ppo-config", "cispo", "dro"],
)
def test_policy_gradient_losses_are_the_documented_ones_and_llmrl_steps_on_their_gradient(
    tinker_service, service_client, tiny_model, name, config
):
    """The loss value and the gradient it leaves on the adapter equal Tinker's formula computed apart on a
    copy of the adapter; the following optim_step is llmrl's AdamW on that gradient."""
    _, tokenizer = tiny_model
    data = rl_data(tokenizer)
    client = training_client(service_client)
    # B starts at 0, so the adapter's gradient reaches only B: nudge it so that A's gradient is tested too.
    served_model = tinker_service.models[client.model_id].peft_model
    with torch.no_grad():
        for parameter_name, parameter in served_model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.copy_(
                    0.01 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3))
                )
    reference = copy.deepcopy(served_model)
    trainable = {n: p for n, p in reference.named_parameters() if p.requires_grad}

    output = client.forward_backward(data, name, config).result(timeout=60)

    expected = 0.0
    for datum, returned in zip(data, output.loss_fn_outputs, strict=True):
        tokens = datum.model_input.to_ints()
        logits = reference(torch.tensor([tokens])).logits[0]
        logprobs, _ = selective_log_softmax(logits, torch.tensor(datum.loss_fn_inputs["target_tokens"].data))
        torch.testing.assert_close(
            torch.tensor(returned["logprobs"].data), logprobs.detach(), atol=1e-5, rtol=1e-5
        )
        expected = expected + documented_loss(name, config, logprobs, datum)
    assert output.metrics["loss:sum"] == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
    expected.backward()
    served = dict(served_model.named_parameters())
    assert_same_gradients(served, trainable)

    # Adam's first step divides by |gradient|: step both on the same (checked) gradient.
    for parameter_name, parameter in trainable.items():
        parameter.grad = served[parameter_name].grad.clone()
    adam = types.AdamParams(learning_rate=1e-3, weight_decay=0.01)
    client.optim_step(adam).result(timeout=60)
    betas, eps = (adam.beta1, adam.beta2), adam.eps
    torch.optim.AdamW(trainable.values(), lr=1e-3, betas=betas, eps=eps, weight_decay=0.01).step()
    for parameter_name, parameter in trainable.items():
        torch.testing.assert_close(served[parameter_name], parameter, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "config", "change", "message"),
    [
        (
            "ppo",
            {"clip": 0.2},
            None,
            r"loss_fn_config\.clip: ppo takes clip_low_threshold, clip_high_threshold$",
        ),
        (
            "ppo",
            {"clip_low_threshold": 1.2},
            None,
            r"needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold",
        ),
        ("dro", {}, None, r"loss_fn_config\.beta: required by dro$"),
        (
            "importance_sampling",
            {},
            "drop advantages",
            r"data\[0\]\.loss_fn_inputs\.advantages: required by importance_sampling$",
        ),
        (
            "cispo",
            {},
            "weights 0.5",
            r"data\[0\]\.loss_fn_inputs\.weights: cispo takes weights as a 0/1 mask",
        ),
        (
            "ppo",
            {},
            "per-token clip",
            r"data\[0\]\.loss_fn_inputs\.clip_low_threshold: ppo takes target_tokens, logprobs, advantages, weights$",
        ),
    ],
    ids=[
        "unknown setting",
        "clip range",
        "dro without beta",
        "no advantages",
        "fractional mask",
        "per-token clip",
    ],
)
def test_bad_policy_gradient_calls_are_refused_naming_the_field(
    service_client, tiny_model, name, config, change, message
):
    _, tokenizer = tiny_model
    datum = rl_data(tokenizer)[0]
    inputs = dict(datum.loss_fn_inputs)
    n = len(inputs["target_tokens"].data)
    if change == "drop advantages":
        del inputs["advantages"]
    elif change == "weights 0.5":
        inputs["weights"] = [0.5] * n
    elif change == "per-token clip":
        inputs["clip_low_threshold"] = [0.8] * n
    datum = types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)
    client = training_client(service_client)
    with pytest.raises(tinker.BadRequestError) as refused:
        client.forward_backward([datum], name, config).result(timeout=60)
    (line,) = refused.value.body["error"]["message"].splitlines()
    assert re.search(message, line), line


def test_forward_backward_custom_trains_on_the_gradient_of_the_users_loss(
    tinker_service, service_client, tiny_model
):
    """The SDK runs a custom loss as a forward, the user's function on the logprobs, and a cross_entropy
    whose weights are minus that function's gradient: the adapter's gradient is the custom loss's."""
    _, tokenizer = tiny_model
    data = sft_data(tokenizer)
    client = training_client(service_client)
    reference = copy.deepcopy(tinker_service.models[client.model_id].peft_model)

    def squared_logprobs(data, logprobs_list):
        loss = sum((logprobs**2).sum() for logprobs in logprobs_list)
        return loss, {"custom:sum": float(loss.detach())}

    output = client.forward_backward_custom(data, squared_logprobs).result(timeout=60)
    expected = 0.0
    for datum in data:
        logits = reference(torch.tensor([datum.model_input.to_ints()])).logits[0]
        logprobs, _ = selective_log_softmax(logits, torch.tensor(datum.loss_fn_inputs["target_tokens"].data))
        expected = expected + (logprobs**2).sum()
    assert output.metrics["loss:sum"] == pytest.approx(expected.item(), rel=1e-5)
    expected.backward()
    served = dict(tinker_service.models[client.model_id].peft_model.named_parameters())
    assert_same_gradients(served, {n: p for n, p in reference.named_parameters() if p.grad is not None})


def sft_steps(client, data, steps: int) -> list[float]:
    """`steps` of cross_entropy and AdamW; each step's loss before its update."""
    losses = []
    for _ in range(steps):
        backward = client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        losses.append(backward.result(timeout=60).metrics["loss:sum"])
    return losses


@pytest.mark.filterwarnings(
    "ignore:DEPRECATED. TrainingClient.load_state:FutureWarning"
)  # still called by users
def test_saved_state_resumes_with_the_same_numbers(base_url, service_client, tiny_model):
    """A client restored with its optimizer continues exactly as the one that saved; restored without, it
    starts from the same weights with a fresh AdamW."""
    _, tokenizer = tiny_model
    data = sft_data(tokenizer)
    saving = training_client(service_client)
    sft_steps(saving, data, 2)
    path = saving.save_state("after-2", user_metadata={"step": "2"}).result(timeout=60).path
    assert path == f"tinker://{saving.model_id}/weights/after-2"
    continued = sft_steps(saving, data, 2)

    with_optimizer = service_client.create_training_client_from_state_with_optimizer(path).result(timeout=60)
    assert sft_steps(with_optimizer, data, 2) == continued
    weights_only = service_client.create_training_client_from_state(path).result(timeout=60)
    fresh_adam = sft_steps(weights_only, data, 2)
    assert fresh_adam[0] == continued[0] and fresh_adam[1] != continued[1]
    # load_state into a client that exists: back to the saved weights.
    saving.load_state(path).result(timeout=60)
    assert sft_steps(saving, data, 1)[0] == continued[0]

    rest = tinker.RestClient(base_url=base_url, api_key="tml-local")
    info = rest.get_weights_info_by_tinker_path(path).result(timeout=30)
    assert (info.base_model, info.lora_rank, info.is_lora, info.train_unembed) == (BASE, 8, True, False)
    (listed,) = rest.list_checkpoints(saving.model_id).result(timeout=30).checkpoints
    assert (listed.tinker_path, listed.checkpoint_type, listed.user_metadata) == (
        path,
        "training",
        {"step": "2"},
    )
    assert listed.size_bytes > 0


def test_named_sampler_weights_sample_as_the_snapshot_and_are_listed(base_url, service_client, tiny_model):
    _, tokenizer = tiny_model
    client = training_client(service_client)
    sft_steps(client, sft_data(tokenizer), 2)
    path = client.save_weights_for_sampler("two-steps").result(timeout=60).path
    assert path == f"tinker://{client.model_id}/sampler_weights/two-steps"
    prompt = types.ModelInput.from_ints(tokenizer("50+25=", add_special_tokens=False)["input_ids"])
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    saved = (
        service_client.create_sampling_client(model_path=path)
        .result(timeout=60)
        .sample(prompt, 1, greedy)
        .result(timeout=60)
    )
    snapshot = (
        client.save_weights_and_get_sampling_client()
        .result(timeout=60)
        .sample(prompt, 1, greedy)
        .result(timeout=60)
    )
    assert saved.sequences[0].tokens == snapshot.sequences[0].tokens
    torch.testing.assert_close(saved.sequences[0].logprobs, snapshot.sequences[0].logprobs, atol=1e-5, rtol=0)
    base = (
        service_client.create_sampling_client(base_model=BASE)
        .result(timeout=60)
        .sample(prompt, 1, greedy)
        .result(timeout=60)
    )
    assert base.sequences[0].logprobs != snapshot.sequences[0].logprobs

    rest = tinker.RestClient(base_url=base_url, api_key="tml-local")
    listed = rest.list_checkpoints(client.model_id).result(timeout=30).checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in listed] == [
        ("sampler_weights/two-steps", "sampler")
    ]
    assert path in [c.tinker_path for c in rest.list_user_checkpoints().result(timeout=30).checkpoints]
    rest.delete_checkpoint(client.model_id, "sampler_weights/two-steps").result(timeout=30)
    assert rest.list_checkpoints(client.model_id).result(timeout=30).checkpoints == []
    with pytest.raises(tinker.NotFoundError, match="model_path: no checkpoint"):
        service_client.create_sampling_client(model_path=path).result(timeout=60)


@pytest.mark.filterwarnings(
    "ignore:DEPRECATED. TrainingClient.load_state:FutureWarning"
)  # still called by users
def test_checkpoint_mistakes_are_refused_in_one_line(base_url, service_client):
    client = training_client(service_client)
    path = client.save_state("once").result(timeout=60).path
    with pytest.raises(
        tinker.TinkerError, match=r"path: tinker://\S+/weights/once exists \(save with overwrite=True"
    ):
        client.save_state("once").result(timeout=60)
    client.save_state("once", overwrite=True).result(timeout=60)
    other_rank = service_client.create_lora_training_client(base_model=BASE, rank=4).result(timeout=60)
    with pytest.raises(
        tinker.TinkerError, match="holds an adapter made as .*rank=8.*not as this client's .*rank=4"
    ):
        other_rank.load_state(path).result(timeout=60)
    with pytest.raises(tinker.TinkerError, match=r"path: no checkpoint tinker://nobody/weights/none in "):
        client.load_state("tinker://nobody/weights/none").result(timeout=60)
    rest = tinker.RestClient(base_url=base_url, api_key="tml-local")
    with pytest.raises(tinker.BadRequestError, match=r"tinker_path: 'tinker://x/y' is not a checkpoint path"):
        rest.get_weights_info_by_tinker_path("tinker://x/y").result(timeout=30)


def test_get_tokenizer_and_compute_logprobs_work_offline(service_client, tiny_model):
    model, tokenizer = tiny_model
    client = training_client(service_client)
    served_tokenizer = client.get_tokenizer()  # from the server's storage folder: no hub
    assert served_tokenizer("12+34=46")["input_ids"] == tokenizer("12+34=46")["input_ids"]

    tokens = tokenizer("12+34=46", add_special_tokens=False)["input_ids"]
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=60)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1]
    expected, _ = selective_log_softmax(logits, torch.tensor(tokens[1:]))
    assert scored[0] is None and len(scored) == len(tokens)
    torch.testing.assert_close(torch.tensor(scored[1:]), expected, atol=1e-5, rtol=0)
    last_two = sampler.compute_logprobs(types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=2)
    last_two = last_two.result(timeout=60)
    assert last_two[:-2] == [None] * (len(tokens) - 2)
    assert last_two[-2:] == pytest.approx(scored[-2:], abs=1e-6)


def test_a_session_keeps_its_most_recently_used_samplers(base_url, tinker_service, monkeypatch, tiny_model):
    _, tokenizer = tiny_model
    monkeypatch.setattr(tinker_service, "max_samplers", 2)
    session = tinker.ServiceClient(base_url=base_url, api_key="tml-local")
    prompt = types.ModelInput.from_ints(tokenizer("7+8=", add_special_tokens=False)["input_ids"])
    params = types.SamplingParams(max_tokens=2, temperature=0.0)

    def new_sampler():
        return session.create_sampling_client(base_model=BASE).result(timeout=60)

    first, second = new_sampler(), new_sampler()
    first.sample(prompt, 1, params).result(timeout=60)  # now the most recently used
    third = new_sampler()
    assert len(first.sample(prompt, 1, params).result(timeout=60).sequences) == 1
    assert len(third.sample(prompt, 1, params).result(timeout=60).sequences) == 1
    with pytest.raises(tinker.NotFoundError, match=r"was released: a session keeps its 2 most recently used"):
        second.sample(prompt, 1, params).result(timeout=60)
    session.close("success").result(timeout=30)


def test_a_future_is_forgotten_after_its_result_was_answered(base_url, monkeypatch):
    monkeypatch.setattr("llmrl.server.tinker.service.FUTURE_KEEP_S", 0.2)
    new_session = types.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="0")
    session = httpx.post(f"{base_url}/api/v1/create_session", json=new_session.model_dump(mode="json")).json()
    create = types.CreateModelRequest(
        session_id=session["session_id"],
        model_seq_id=0,
        base_model=BASE,
        lora_config=types.LoraConfig(rank=2),
    ).model_dump(mode="json")
    request_id = httpx.post(f"{base_url}/api/v1/create_model", json=create).json()["request_id"]
    answered = httpx.post(f"{base_url}/api/v1/retrieve_future", json={"request_id": request_id}, timeout=60)
    assert "model_id" in answered.json()
    time.sleep(0.5)
    forgotten = httpx.post(f"{base_url}/api/v1/retrieve_future", json={"request_id": request_id})
    assert forgotten.status_code == 404
    assert "a result is kept 0 s after it was first answered" in forgotten.json()["error"]["message"]


def test_training_runs_are_listed_from_memory_and_storage(base_url, service_client):
    client = training_client(service_client)
    path = client.save_state("listed").result(timeout=60).path
    rest = tinker.RestClient(base_url=base_url, api_key="tml-local")
    run = rest.get_training_run(client.model_id).result(timeout=30)
    assert (run.base_model, run.lora_rank, run.is_lora) == (BASE, 8, True)
    assert run.last_checkpoint.tinker_path == path and run.last_sampler_checkpoint is None
    listed = rest.list_training_runs(limit=100).result(timeout=30)
    assert client.model_id in [r.training_run_id for r in listed.training_runs]
    assert listed.cursor.total_count >= len(listed.training_runs)
    with pytest.raises(tinker.NotFoundError, match="training_run_id: no training run 'nobody'"):
        rest.get_training_run("nobody").result(timeout=30)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "Invalid JSON"),
        (b'{"tinker_path": 3}', "tinker_path: Input should be a valid string"),
        (b"{}", "tinker_path: Field required"),
    ],
    ids=["not json", "not a string", "absent"],
)
def test_a_malformed_weights_info_request_is_a_422_naming_the_field(base_url, body, message):
    answer = httpx.post(
        f"{base_url}/api/v1/weights_info", content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 422
    (line,) = answer.json()["error"]["message"].splitlines()
    assert message in line, line
