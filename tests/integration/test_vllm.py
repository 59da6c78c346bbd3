"""llmrl against real vLLM servers (the CPU build here; `bash scripts/setup.sh vllm` installs it).

Two servers of the tiny model start once for the module (side by side, ~1 min on 2 cores). Every
check compares with a Hugging Face forward pass of the weights the server should hold: token ids,
logprobs (at several temperatures, with top-k/top-p), greedy output after each transport's sync
(every tensor changed, the embeddings included, which the tied LM head shares), and the old
weights after an update that was refused. Then a dead server, a managed restart, and `llmrl
train` end to end, with no vLLM process left behind.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save
from transformers import AutoModelForCausalLM

from llmrl.config import ModelConfig, VLLMConfig
from llmrl.inference.vllm import VLLMInterface, VLLMServer, served_model_path
from llmrl.processes import free_port
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest

pytestmark = pytest.mark.slow

CONFIG = VLLMConfig(max_model_len=256, cpu_kv_cache_gib=1, startup_timeout_s=300)
PROMPTS = ["12 + 34 =", "7 + 58 =", "90 + 9 ="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(served_model_path(ModelConfig(), tmp_path_factory.mktemp("vllm") / "model"))


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-logs")
    started = [
        VLLMServer(
            model=str(model_dir),
            dtype="float32",
            config=CONFIG,
            port=free_port(),
            seed=0,
            log_path=logs / f"server-{i}.log",
        )
        for i in range(2)
    ]
    try:
        for server in started:
            server.spawn()
        for server in started:
            server.wait_ready()
        yield started
    finally:
        for server in started:
            server.close()


@pytest.fixture(scope="module")
def base_weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor changed (embeddings too: a tied LM head must follow them)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in weights.items()}


def reference(model_dir: Path, weights: dict[str, torch.Tensor]):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.load_state_dict(weights, strict=False)  # lm_head is tied to the embeddings
    return model.eval()


def reference_logprobs(model, prompt_ids, token_ids, *, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """log_softmax of the processed logits (temperature, then top-k, then top-p) at each sampled token."""
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # mass of the tokens ranked above
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.log_softmax(-1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def request(prompt: str, **args) -> InferenceRequest:
    return InferenceRequest(
        prompt=[ChatMessage(role="user", content=prompt)],
        n=args.pop("n", 4),
        generation_args=GenerationArgs(max_tokens=12, seed=1, **args),
    )


def max_logprob_gap(vllm: VLLMInterface, model, **args) -> float:
    gaps = []
    for prompt in PROMPTS:
        for response in vllm.generate(request(prompt, **args)):
            expected = reference_logprobs(
                model,
                response.prompt_token_ids,
                response.token_ids,
                temperature=args.get("temperature", 1.0),
                top_k=args.get("top_k", 0),
                top_p=args.get("top_p", 1.0),
            )
            gaps.append((expected - torch.tensor(response.logprobs)).abs().max().item())
    return max(gaps)


def greedy_matches(vllm: VLLMInterface, model) -> bool:
    for prompt in PROMPTS:
        response = vllm.generate(request(prompt, n=1, temperature=0.0))[0]
        ids = torch.tensor([response.prompt_token_ids])
        with torch.no_grad():
            expected = model.generate(
                ids,
                max_new_tokens=len(response.token_ids),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, ids.shape[1] :]
        if expected.tolist() != response.token_ids:
            return False
    return True


def test_token_ids_and_logprobs_match_a_forward_pass(servers, model_dir, base_weights):
    vllm = VLLMInterface([servers[0].base_url], config=CONFIG)
    vllm.update_weights(base_weights, version=0, reset=True)
    model = reference(model_dir, base_weights)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    response = vllm.generate(request(PROMPTS[0], n=1))[0]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert response.prompt_token_ids == list(chat["input_ids"])
    for args in ({"temperature": 1.0}, {"temperature": 0.7}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20}):
        assert max_logprob_gap(vllm, model, **args) < 1e-4, args


@pytest.mark.parametrize("transport", ["http", "disk"])
def test_each_transport_serves_the_new_weights_on_every_server(
    servers, model_dir, base_weights, transport, tmp_path
):
    config = CONFIG.model_copy(update={"transport": transport})
    vllm = VLLMInterface([s.base_url for s in servers], config=config, weights_dir=tmp_path)
    new = perturbed(base_weights, seed={"http": 1, "disk": 2}[transport])
    vllm.update_weights(new, version=5, reset=True)
    for server in servers:
        assert httpx.get(f"{server.base_url}/weight_info").json()["weight_version"] == "5"
    model = reference(model_dir, new)
    assert greedy_matches(vllm, model)
    assert max_logprob_gap(vllm, model, temperature=1.0) < 1e-4
    vllm.update_weights(base_weights, version=6)
    vllm.close()
    assert list(tmp_path.iterdir()) == []  # the weight files of a disk sync are deleted


def test_an_update_waits_for_a_running_request_which_finishes_on_the_old_weights(
    servers, model_dir, base_weights
):
    vllm = VLLMInterface([servers[0].base_url], config=CONFIG)
    vllm.update_weights(base_weights, version=10, reset=True)
    answers = []
    long_request = {
        "model": str(model_dir),
        "prompt": "12 + 34 =",
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": 1,
        "return_token_ids": True,
    }
    thread = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{servers[0].base_url}/v1/completions", json=long_request, timeout=120).json()
        )
    )
    thread.start()
    time.sleep(0.5)  # the request is running
    new = perturbed(base_weights, seed=3)
    vllm.update_weights(new, version=11)
    thread.join()
    choice = answers[0]["choices"][0]
    assert len(choice["token_ids"]) == 200
    old_model = reference(model_dir, base_weights)
    expected = reference_logprobs(old_model, choice["prompt_token_ids"], choice["token_ids"])
    assert (expected - torch.tensor(choice["logprobs"]["token_logprobs"])).abs().max() < 1e-4
    assert max_logprob_gap(vllm, reference(model_dir, new)) < 1e-4


def test_a_refused_update_leaves_the_old_weights_serving(servers, model_dir, base_weights):
    vllm = VLLMInterface([servers[0].base_url], config=CONFIG)
    vllm.update_weights(base_weights, version=20, reset=True)
    bad = perturbed(base_weights, seed=4) | {"model.norm.weight": torch.ones(7)}
    with pytest.raises(ValueError, match="shape"):  # refused by llmrl before anything is sent
        vllm.update_weights(bad, version=21)
    # The same bucket sent by hand, past llmrl's checks: the server refuses it and keeps serving.
    url = servers[0].base_url
    assert httpx.post(f"{url}/pause?mode=wait").status_code == 200
    assert httpx.post(f"{url}/start_weight_update").status_code == 200
    body = {"update_info": {"names": list(bad), "data": base64.b64encode(save(bad)).decode()}}
    refused = httpx.post(f"{url}/update_weights", json=body, timeout=60)
    assert refused.status_code == 500 and "model.norm.weight" in refused.text
    assert httpx.post(f"{url}/resume").status_code == 200
    assert max_logprob_gap(vllm, reference(model_dir, base_weights)) < 1e-4
    assert greedy_matches(vllm, reference(model_dir, base_weights))


def test_requests_spread_over_servers_survive_a_dead_one_and_a_managed_one_restarts(
    servers, model_dir, base_weights
):
    external = VLLMInterface([s.base_url for s in servers], config=CONFIG)
    new = perturbed(base_weights, seed=5)
    external.update_weights(new, version=30, reset=True)

    async def burst(interface: VLLMInterface, count: int) -> None:
        import asyncio

        await asyncio.gather(*(interface.agenerate(request(PROMPTS[i % 3])) for i in range(count)))

    from llmrl.inference import run_sync

    run_sync(burst(external, 16))
    assert all(e.served > 0 for e in external._endpoints), [e.served for e in external._endpoints]
    managed = VLLMInterface([s.base_url for s in servers], config=CONFIG, servers=servers)
    managed.update_weights(new, version=31)
    os.killpg(servers[1].process.pid, signal.SIGKILL)  # a server dies
    time.sleep(1)
    served_before = [e.served for e in external._endpoints]
    run_sync(burst(external, 8))  # external: its requests go to the live server
    assert external._endpoints[0].served == served_before[0] + 8
    assert external._endpoints[1].served == served_before[1]
    run_sync(burst(managed, 8))  # managed: restarted, given version 31, and used again
    assert managed._endpoints[1].restarts == 1 and servers[1].alive()
    assert httpx.get(f"{servers[1].base_url}/weight_info").json()["weight_version"] == "31"
    only_second = VLLMInterface([servers[1].base_url], config=CONFIG)
    assert max_logprob_gap(only_second, reference(model_dir, new)) < 1e-4


def vllm_processes(run_dir: Path) -> list[str]:
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if "vllm" in line and str(run_dir) in line]


def train_command(example: str, run_dir: Path, *overrides: str) -> list[str]:
    """`llmrl train examples/EXAMPLE` for a short run in `run_dir`, with `overrides`."""
    settings = [
        f"run_dir={run_dir}",
        "evaluation.every=0",
        "training.prompts_per_step=16",
        "logging.progress=plain",
    ]
    command = [sys.executable, "-m", "llmrl", "train", f"examples/{example}"]
    for setting in [*settings, *overrides]:
        command += ["--set", setting]
    return command


def run_training(command: list[str], run_dir: Path) -> list[dict]:
    """Run `command` from the checkout's root to its end; the metrics it logged in `run_dir`."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_llmrl_train_on_managed_vllm_learns_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    command = train_command(
        "arithmetic_vllm.yaml", run_dir, "training.steps=4", "inference.vllm.cpu_kv_cache_gib=1"
    )
    lines = run_training(command, run_dir)
    steps = [line for line in lines if "train/mismatch_kl" in line]
    assert len(steps) == 4 and max(abs(s["train/mismatch_kl"]) for s in steps) < 1e-5
    assert all(s["time/sync_s"] < 30 for s in steps)
    assert "eval/arithmetic/pass@1" in lines[-1]
    assert (run_dir / "vllm" / "server-0.log").is_file()
    assert vllm_processes(run_dir) == []

    # Ctrl-C twice (the second stops at once) while it trains: still no process left.
    resumed = subprocess.Popen(
        [*command, "--set", "training.steps=40"],
        cwd=Path(__file__).parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert resumed.stdout is not None
    for line in resumed.stdout:
        if line.startswith("step "):
            break
    resumed.send_signal(signal.SIGINT)
    time.sleep(0.5)
    resumed.send_signal(signal.SIGINT)
    resumed.wait(120)
    time.sleep(2)
    assert vllm_processes(run_dir) == []
