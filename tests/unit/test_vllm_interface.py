"""VLLMInterface against a scripted vLLM (httpx mock): start-up checks, the weight-sync route
sequence, buckets and the checks before sending. The real server is in tests/integration/test_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from llmrl.config import ConfigError, InferenceConfig, VLLMConfig, config_from_dict
from llmrl.inference.openai import UnsupportedServerError, WeightSyncError
from llmrl.inference.vllm import VLLMInterface, find_vllm_python
from llmrl.types import InferenceRequest
from llmrl.weights import AdapterWeights, check_weights, read_adapter, weight_buckets

STATE = {
    "model.embed_tokens.weight": torch.randn(8, 4),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4),
    "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 4),
    "model.layers.0.mlp.gate_proj.weight": torch.randn(6, 4),
    "model.layers.1.self_attn.q_proj.weight": torch.randn(4, 4),
    "model.norm.weight": torch.randn(4),
}
MANIFEST = {name: {"dtype": "F32", "shape": list(t.shape)} for name, t in STATE.items()}


class ScriptedVLLM:
    """Answers like a vLLM server in dev mode with llmrl's extension; records every call."""

    def __init__(self, **facts: Any):
        self.facts = {
            "logprobs_mode": "processed_logprobs",
            "weight_transfer_backend": "llmrl",
            "manifest": MANIFEST,
        } | facts
        self.calls: list[str] = []
        self.weight_version: str | None = None
        self.fail: dict[str, int] = {}  # path -> status to answer with
        self.routes_missing = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append(path)
        if path in self.fail:
            return httpx.Response(self.fail[path], json={"error": {"message": f"{path} broke"}})
        if path == "/health":
            return httpx.Response(200)
        if self.routes_missing and path in ("/weight_info", "/collective_rpc"):
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/collective_rpc":
            return httpx.Response(200, json={"results": [self.facts]})
        if path == "/finish_weight_update":
            self.weight_version = json.loads(request.content)["weight_version"]
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.weight_version})
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        return httpx.Response(200, json={"status": "ok"})


def interface(server: ScriptedVLLM, bucket_mb: int = 512, **config: Any) -> VLLMInterface:
    return VLLMInterface(
        ["http://vllm:8000"],
        config=VLLMConfig(**config),
        bucket_mb=bucket_mb,
        transport=httpx.MockTransport(server),
    )


def test_a_sync_walks_vllm_rl_routes_in_order_and_confirms_the_version():
    server = ScriptedVLLM()
    vllm = interface(server, bucket_mb=1)
    server.calls.clear()
    vllm.update_weights(STATE, version=3)
    assert server.calls == [
        "/pause",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
        "/weight_info",
    ]
    assert server.weight_version == "3" and vllm.policy_version == 3
    server.calls.clear()
    vllm.update_weights(STATE, version=3)  # the served version again: nothing to do
    assert server.calls == []
    with pytest.raises(WeightSyncError, match="older"):
        vllm.update_weights(STATE, version=2)
    vllm.update_weights(STATE, version=2, reset=True)  # a resumed run owns the sequence
    assert server.weight_version == "2"


def test_a_failed_update_still_resumes_the_server_and_names_the_call():
    server = ScriptedVLLM()
    server.fail["/update_weights"] = 500
    vllm = interface(server)
    server.calls.clear()
    with pytest.raises(WeightSyncError, match=r"POST /update_weights answered 500: /update_weights broke"):
        vllm.update_weights(STATE, version=1)
    assert server.calls[-1] == "/resume" and "/finish_weight_update" not in server.calls
    assert vllm.policy_version == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"routes_missing": True}, "VLLM_SERVER_DEV_MODE=1"),
        ({"logprobs_mode": "raw_logprobs"}, "--logprobs-mode processed_logprobs"),
        ({"weight_transfer_backend": None}, "--weight-transfer-config"),
    ],
)
def test_a_server_that_cannot_be_trained_from_is_named_with_the_missing_flag(change, message):
    server = ScriptedVLLM()
    if change.pop("routes_missing", False):
        server.routes_missing = True
    server.facts |= change
    with pytest.raises(UnsupportedServerError, match=message):
        interface(server)


def test_a_continuation_without_the_tokenizer_is_refused_before_it_is_sent():
    server = ScriptedVLLM()
    vllm = interface(server)
    server.calls.clear()
    with pytest.raises(UnsupportedServerError, match="needs the model's tokenizer"):
        vllm.generate(InferenceRequest(prompt="", prompt_token_ids=[1, 2]))
    assert server.calls == []


def test_weights_are_checked_against_the_served_checkpoint_before_anything_is_sent():
    server = ScriptedVLLM()
    vllm = interface(server)
    cases = {
        "shape": STATE | {"model.norm.weight": torch.randn(5)},
        "NaN": STATE | {"model.norm.weight": torch.full((4,), float("nan"))},
        "floating": STATE | {"model.norm.weight": torch.ones(4, dtype=torch.int64)},
        "missing": {k: v for k, v in STATE.items() if "k_proj" not in k},  # half of a fused qkv
        "lacks": STATE | {"model.extra.weight": torch.randn(2)},
    }
    for message, state in cases.items():
        server.calls.clear()
        with pytest.raises(ValueError, match=message):
            vllm.update_weights(state, version=1)
        assert server.calls == []


def test_streamed_buckets_are_checked_as_a_whole_then_sent_one_request_each():
    server = ScriptedVLLM()
    vllm = interface(server, bucket_mb=1)
    sizes = {name: t.numel() * 4 for name, t in STATE.items()}
    parts = [{name: STATE[name] for name in names} for names in weight_buckets(list(STATE), sizes, 100)]
    assert len(parts) > 2
    for message, broken in {
        "missing": parts[:-1],
        "NaN": [*parts[:-1], {n: t * float("nan") for n, t in parts[-1].items()}],
    }.items():
        server.calls.clear()
        with pytest.raises(ValueError, match=message):
            vllm.update_weights(iter(broken), version=1)
        assert server.calls == []
    server.calls.clear()
    vllm.update_weights(iter(parts), version=1)
    assert server.calls.count("/update_weights") == len(parts) and server.weight_version == "1"


def test_buckets_are_bounded_and_never_split_a_layer():
    sizes = {name: t.numel() * 4 for name, t in STATE.items()}
    buckets = weight_buckets(list(STATE), sizes, bucket_bytes=100)
    assert sorted(n for b in buckets for n in b) == sorted(STATE)
    layer0 = [b for b in buckets if any("layers.0." in n for n in b)]
    assert len(layer0) == 1 and len([n for n in layer0[0] if "layers.0." in n]) == 3
    assert len(weight_buckets(list(STATE), sizes, bucket_bytes=1 << 30)) == 1
    check_weights(STATE, MANIFEST, "server")  # the state itself passes


def test_config_picks_external_servers_from_base_url_and_validates_the_section():
    environments = [{"agent_type": "arithmetic"}]
    config = config_from_dict(
        {
            "environments": environments,
            "inference": {
                "type": "vllm",
                "base_url": ["http://a:1", "http://b:2"],
                "weight_sync_bucket_mb": 64,
                "vllm": {"transport": "disk"},
            },
        }
    )
    assert isinstance(config.inference, InferenceConfig) and config.inference.vllm.transport == "disk"
    with pytest.raises(ValueError, match="inference.vllm.transport"):
        config_from_dict(
            {"environments": environments, "inference": {"vllm": {"transport": "carrier-pigeon"}}}
        )
    with pytest.raises(ValueError, match="weights_dir"):
        VLLMInterface(["http://a:1"], config=VLLMConfig(transport="disk"))


def test_a_configured_vllm_python_that_does_not_exist_is_named(tmp_path):
    from llmrl.inference.vllm import VLLMStartError

    with pytest.raises(VLLMStartError, match="inference.vllm.python"):
        find_vllm_python(str(tmp_path / "nope" / "python"))


def test_an_incompatible_server_is_one_user_error_naming_every_missing_flag_and_the_command():
    from llmrl.errors import UserError

    server = ScriptedVLLM(logprobs_mode="raw_logprobs", weight_transfer_backend=None)
    with pytest.raises(UserError) as refused:
        interface(server)
    message = str(refused.value)
    assert "\n" not in message
    lacks = message.split("lacks: ")[1].split(". Start it")[0]
    assert "--logprobs-mode processed_logprobs" in lacks and "--weight-transfer-config" in lacks
    assert "VLLM_SERVER_DEV_MODE" not in lacks and "--worker-extension-cls" not in lacks
    assert message.endswith(
        "VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs --worker-extension-cls "
        'llmrl.weights.vllm_worker.LlmrlWorkerExtension --weight-transfer-config \'{"backend": "llmrl"}\''
    )


def test_llmrl_train_against_an_incompatible_server_exits_2_with_one_line(monkeypatch, capsys):
    from llmrl import cli
    from llmrl.inference.vllm import IncompatibleServerError

    def refuse(*args, **kwargs):
        raise IncompatibleServerError(
            "vLLM at http://h:1 cannot be trained from; it lacks: X. Start it as: Y"
        )

    monkeypatch.setattr("llmrl.trainer.Trainer", refuse)
    assert cli.main(["train"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_sync_to_a_server_that_stopped_answering_reports_it_unreachable():
    server = ScriptedVLLM()
    vllm = interface(server)
    assert vllm.health().unreachable_since is None and vllm.health().servers == ("http://vllm:8000/v1",)

    def dead(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    vllm._endpoints[0].routes.settings = vllm._endpoints[0].routes.settings.__class__(
        1, 1, transport=httpx.MockTransport(dead)
    )
    with pytest.raises(WeightSyncError, match="ConnectError"):
        vllm.update_weights(STATE, version=1)
    assert vllm.health().unreachable_since is not None


class FakeServer:
    """A managed server that dies when told to and comes back on `start`."""

    def __init__(self):
        self.up = True

    def alive(self):
        return self.up

    def exit_description(self):
        return "it was killed by SIGKILL"

    def stop(self):
        self.up = False

    def start(self):
        self.up = True

    def close(self):
        self.up = False


def test_a_restarted_managed_server_is_announced_in_one_line(caplog):
    server = ScriptedVLLM()
    managed = FakeServer()
    vllm = VLLMInterface(
        ["http://vllm:8000"], config=VLLMConfig(), servers=[managed], transport=httpx.MockTransport(server)
    )
    vllm.update_weights(STATE, version=4)
    managed.up = False
    endpoint = vllm._endpoints[0]
    with caplog.at_level("WARNING"):
        for _ in range(8):  # many failed requests, one restart
            assert vllm._recover(0, "a request failed (ConnectError)")
            managed.up = True
    lines = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
    assert lines == [
        "vLLM server 0 at http://vllm:8000 restarted (restart 1 of 3): a request failed (ConnectError), "
        "it was killed by SIGKILL; given weights version 4"
    ]
    assert endpoint.restarts == 1 and server.weight_version == "4"


# -- LoRA adapters -------------------------------------------------------------------------------

LORA_FACTS = {"lora": {"max_lora_rank": 8, "max_loras": 3}}


def scripted_adapter(seed: int) -> AdapterWeights:
    """A rank-4 adapter of two of STATE's linear layers, in PEFT's names and config."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj"):
        out_features, in_features = STATE[f"{module}.weight"].shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(4, in_features, generator=generator)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(
            out_features, 4, generator=generator
        )
    return AdapterWeights(tensors, {"r": 4, "lora_alpha": 8, "peft_type": "LORA"})


class GeneratingVLLM(ScriptedVLLM):
    """Also answers chat completions, recording the model each asked for."""

    def __init__(self, **facts: Any):
        super().__init__(**facts)
        self.models: list[str] = []
        self.loads: list[dict[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            self.models.append(json.loads(request.content)["model"])
            choice = {
                "message": {"content": "1"},
                "token_ids": [5],
                "logprobs": {"content": [{"logprob": -0.1}]},
            }
            return httpx.Response(200, json={"choices": [choice], "prompt_token_ids": [1, 2]})
        if request.url.path == "/v1/load_lora_adapter" and request.content:  # not the start-up probe
            self.loads.append(json.loads(request.content))
        return super().__call__(request)


def lora_interface(server: ScriptedVLLM, weights_dir=None) -> VLLMInterface:
    return VLLMInterface(
        ["http://vllm:8000"],
        config=VLLMConfig(max_loras=3),
        transport=httpx.MockTransport(server),
        lora_rank=4,
        weights_dir=weights_dir,
    )


def ask(vllm: VLLMInterface) -> int:
    from llmrl.types import ChatMessage, InferenceRequest

    prompt = [ChatMessage(role="user", content="1 + 1 =")]
    return vllm.generate(InferenceRequest(prompt=prompt))[0].policy_version


def test_each_adapter_version_loads_under_its_own_name_and_the_requests_after_it_ask_for_it(tmp_path):
    server = GeneratingVLLM(**LORA_FACTS)
    vllm = lora_interface(server, tmp_path)
    server.calls.clear()
    vllm.update_weights(scripted_adapter(1), version=1)
    assert server.calls == ["/v1/load_lora_adapter"]  # no pause: running requests keep their version
    first = server.loads[0]
    assert first["lora_name"].startswith("llmrl-v1-")
    assert read_adapter(first["lora_path"]).config["r"] == 4  # PEFT's folder, in weights_dir
    assert Path(first["lora_path"]).parent == tmp_path
    assert ask(vllm) == 1 and server.models[-1] == first["lora_name"]

    # A request still running on version 1 keeps it loaded through the next sync ...
    vllm.transport.states[0].running[first["lora_name"]] += 1
    vllm.update_weights(scripted_adapter(2), version=2)
    second = server.loads[1]
    assert "/v1/unload_lora_adapter" not in server.calls and Path(first["lora_path"]).is_dir()
    assert ask(vllm) == 2 and server.models[-1] == second["lora_name"]
    # ... and once it is done, the sync after that unloads it and deletes its folder.
    vllm.transport.states[0].running[first["lora_name"]] -= 1
    vllm.update_weights(scripted_adapter(3), version=3)
    assert server.calls.count("/v1/unload_lora_adapter") == 2  # versions 1 and 2
    assert [p.name for p in tmp_path.iterdir()] == [server.loads[2]["lora_name"]]
    vllm.close()
    assert list(tmp_path.iterdir()) == []


def test_an_adapter_is_checked_against_the_served_checkpoint_and_the_interface_takes_one_kind():
    server = GeneratingVLLM(**LORA_FACTS)
    vllm = lora_interface(server)
    server.calls.clear()
    wrong = scripted_adapter(1)
    wrong.tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"] = torch.ones(5, 4)
    with pytest.raises(ValueError, match=r"gate_proj.lora_B.weight.*shape \[5, 4\].*\[6, 4\]"):
        vllm.update_weights(wrong, version=1)
    with pytest.raises(WeightSyncError, match="serves LoRA adapters, not whole weights"):
        vllm.update_weights(STATE, version=1)
    with pytest.raises(WeightSyncError, match="serves whole weights, not LoRA adapters"):
        interface(ScriptedVLLM()).update_weights(scripted_adapter(1), version=1)
    assert server.calls == []


@pytest.mark.parametrize(
    ("facts", "load_route", "lacks"),
    [
        ({"lora": None}, 400, ["--enable-lora --max-lora-rank 8 --max-loras 3"]),
        ({"lora": {"max_lora_rank": 1, "max_loras": 2}}, 400, ["--max-lora-rank 8", "--max-loras 3"]),
        (LORA_FACTS, 404, ["VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment"]),
    ],
)
def test_a_server_without_lora_for_the_adapters_is_named_with_the_missing_flags(facts, load_route, lacks):
    from llmrl.inference.vllm import IncompatibleServerError

    server = ScriptedVLLM(**facts)
    server.fail["/v1/load_lora_adapter"] = load_route  # 400: the route is there (an empty load)
    with pytest.raises(IncompatibleServerError) as refused:
        lora_interface(server)
    message = str(refused.value)
    assert all(flag in message.split("lacks: ")[1].split(". Start it")[0] for flag in lacks), message
    assert message.startswith("vLLM at http://vllm:8000 cannot be trained from")
    assert " VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve MODEL " in message
    assert message.endswith("--enable-lora --max-lora-rank 8 --max-loras 3")


def test_managed_servers_of_adapters_get_lora_flags_and_their_routes(tmp_path):
    import sys

    from llmrl.config import load_config
    from llmrl.inference.vllm import VLLMServer

    config = load_config(None, ["inference.type=vllm", "model.lora={rank: 12}", "training.generation_lag=2"])
    assert config.inference_for_run().vllm.max_loras == 4  # the lag's versions (3) and the one loading
    assert config.inference.vllm.max_loras is None  # the section as written stays as it was
    server = VLLMServer(
        model="m",
        dtype="float32",
        config=config.inference_for_run().vllm.model_copy(update={"python": sys.executable}),
        port=1,
        log_path=tmp_path / "log",
        seed=0,
        lora_rank=12,
    )
    assert " --enable-lora --max-lora-rank 16 --max-loras 4" in " ".join(server.command())
    assert server.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    full = VLLMServer(model="m", dtype="float32", config=server.config, port=1, log_path=tmp_path, seed=0)
    assert "--enable-lora" not in full.command()
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in full.environment()
    with pytest.raises(ConfigError, match="model.lora.rank"):
        load_config(None, ["inference.type=vllm", "model.lora={rank: 600}"])


def test_a_restarted_managed_server_loads_the_last_adapter_again_and_serves_it(tmp_path):
    server = GeneratingVLLM(**LORA_FACTS)
    managed = FakeServer()
    vllm = VLLMInterface(
        ["http://vllm:8000"],
        config=VLLMConfig(max_loras=3),
        servers=[managed],
        transport=httpx.MockTransport(server),
        lora_rank=4,
        weights_dir=tmp_path,
    )
    vllm.update_weights(scripted_adapter(1), version=1)
    vllm.update_weights(scripted_adapter(2), version=2)
    managed.up = False
    assert vllm._recover(0, "a request failed (ConnectError)")
    assert [load["lora_name"] for load in server.loads[1:]] == [server.loads[1]["lora_name"]] * 2
    assert vllm.transport.states[0].loaded == {server.loads[1]["lora_name"]}
    assert ask(vllm) == 2 and server.models[-1] == server.loads[1]["lora_name"]
