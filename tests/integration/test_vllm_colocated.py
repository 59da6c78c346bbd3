"""llmrl with vLLM's engine in the trainer's process (`inference.vllm.mode: colocate`), against the
real vLLM (its CPU build here; `bash scripts/setup.sh vllm` installs it in .venv-vllm).

The engine needs vllm in the test's own interpreter. Under the trainer's environment (.venv, no vllm)
this module holds `llmrl train` end to end, which switches to .venv-vllm's Python by itself, and one
test that runs this same file with .venv-vllm's Python; there, it holds the engine's checks: one
engine of the tiny model starts for the module, and every check compares with a Hugging Face forward
pass of the weights it should hold (logprobs after each in-memory sync, the embeddings and so the
tied LM head included; the old weights after a refused update; a request running during a sync).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmrl.config import ConfigError, InferenceConfig, ModelConfig, VLLMConfig
from llmrl.inference.vllm import find_vllm_python, served_model_path
from llmrl.types import GenerationArgs, InferenceRequest
from llmrl.weights import FullWeights, WeightSyncError
from tests.integration.test_vllm import (
    greedy_matches,
    max_logprob_gap,
    perturbed,
    reference,
    reference_logprobs,
    run_training,
    train_command,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
CONFIG = VLLMConfig(mode="colocate", max_model_len=256, cpu_kv_cache_gib=1)
COLOCATED = ("inference.type=vllm", "inference.vllm.mode=colocate", "inference.vllm.max_model_len=256")
ENGINE_CHECKS = 11  # the tests below that run in vLLM's interpreter

if importlib.util.find_spec("vllm") is None:

    def test_the_engine_checks_pass_in_vllms_interpreter():
        done = subprocess.run(
            [find_vllm_python(None), "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-m", "slow"],
            capture_output=True,
            text=True,
            timeout=590,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
        assert f"{ENGINE_CHECKS} passed" in done.stdout, done.stdout[-2000:]

    # A constant rate: a schedule over 2 steps would not be the first half of one over 4.
    SHORT_RUN = ("training.steps=4", "checkpoint.every=2", "training.lr_schedule=constant")

    @pytest.fixture(scope="module")
    def straight(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
        """The colocated example, 4 steps in one process: its run folder and what the command printed."""
        run_dir = tmp_path_factory.mktemp("colocated") / "straight"
        command = train_command("arithmetic_vllm_colocate.yaml", run_dir, *SHORT_RUN)
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return run_dir, done

    def metrics_of(run_dir: Path) -> list[dict]:
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def rollouts_of(run_dir: Path) -> list[dict]:
        return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]

    def test_llmrl_train_colocated_switches_interpreter_learns_and_resumes_exactly(straight, tmp_path):
        run_dir, done = straight
        assert "running with" in done.stderr and ".venv-vllm" in done.stderr
        lines = metrics_of(run_dir)
        steps = [line for line in lines if "train/mismatch_kl" in line]
        assert len(steps) == 4 and max(abs(s["train/mismatch_kl"]) for s in steps) < 1e-6
        assert "eval/arithmetic/pass@1" in lines[-1]
        assert {r["step"]: r["policy_version"] for r in rollouts_of(run_dir)} == {1: 0, 2: 1, 3: 2, 4: 3}

        # Two steps, then a second command that resumes from the checkpoint: the same numbers.
        halves = tmp_path / "halves"
        run_training(
            train_command("arithmetic_vllm_colocate.yaml", halves, "training.steps=2", *SHORT_RUN[1:]), halves
        )
        resumed = run_training(train_command("arithmetic_vllm_colocate.yaml", halves, *SHORT_RUN), halves)
        resumed_steps = [line for line in resumed if "train/loss" in line]
        for key in ("train/loss", "reward/mean", "train/mismatch_kl", "train/grad_norm"):
            assert [s[key] for s in resumed_steps] == [s[key] for s in steps], key

    def test_under_torchrun_every_process_runs_an_engine_and_the_run_equals_one_process(straight, tmp_path):
        """Two processes, an engine in each serving rank 0's agents, weights synced from the FSDP2
        shards into each: the same samples as one process (seeded requests), the same losses up to
        the order of the shards' additions, and the final evaluation over both engines."""
        one, two = straight[0], tmp_path / "two"
        command = train_command("arithmetic_vllm_colocate.yaml", two, *SHORT_RUN)
        torchrun = [command[0], "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        done = subprocess.run(torchrun + command[1:], capture_output=True, text=True, timeout=600, cwd=ROOT)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-5000:]
        assert "Traceback" not in output and "terminate called" not in output, output[-5000:]
        completions = [[(r["problem_id"], r["completion"]) for r in rollouts_of(run)] for run in (one, two)]
        assert completions[0] == completions[1]
        assert {r["step"]: r["policy_version"] for r in rollouts_of(two)} == {1: 0, 2: 1, 3: 2, 4: 3}
        steps = {run: [line for line in metrics_of(run) if "train/loss" in line] for run in (one, two)}
        assert [s["train/loss"] for s in steps[two]] == pytest.approx(
            [s["train/loss"] for s in steps[one]], rel=1e-4, abs=1e-7
        )
        assert max(abs(s["train/mismatch_kl"]) for s in steps[two]) < 1e-6
        assert metrics_of(two)[-1]["eval/arithmetic/pass@1"] == metrics_of(one)[-1]["eval/arithmetic/pass@1"]

    def test_an_agent_program_with_retries_trains_colocated(tmp_path):
        """The retry example: a program on the `openai` client, several calls per episode (multi-turn)."""
        run_dir = tmp_path / "retry"
        lines = run_training(
            train_command("arithmetic_retry_agent.yaml", run_dir, "training.steps=2", *COLOCATED), run_dir
        )
        steps = [line for line in lines if "train/mismatch_kl" in line]
        assert len(steps) == 2 and max(abs(s["train/mismatch_kl"]) for s in steps) < 1e-6
        assert all(s["reward/retry/calls"] > 1 for s in steps)

    def test_the_lora_example_trains_colocated(tmp_path):
        run_dir = tmp_path / "lora"
        lines = run_training(
            train_command("arithmetic_lora.yaml", run_dir, "training.steps=2", *COLOCATED), run_dir
        )
        steps = [line for line in lines if "train/mismatch_kl" in line]
        assert len(steps) == 2 and max(abs(s["train/mismatch_kl"]) for s in steps) < 1e-6
        assert steps[-1]["sync/bytes"] > 0

    def test_the_engine_starts_no_process_and_ctrl_c_leaves_none(tmp_path):
        command = train_command("arithmetic_vllm_colocate.yaml", tmp_path / "run", "training.steps=40")
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("step "):
                break
        # The trainer itself, after it switched interpreters: a kill leaves nothing either.
        session = subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True).stdout
        assert session.split() == [str(process.pid)]
        process.send_signal(signal.SIGINT)
        process.wait(120)
        assert process.returncode == 130
        time.sleep(1)
        assert subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True).stdout == ""

else:
    from llmrl.inference.vllm.colocated import ColocatedVLLM

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory) -> Path:
        return Path(served_model_path(ModelConfig(), tmp_path_factory.mktemp("colocated") / "model"))

    @pytest.fixture(scope="module")
    def engine(model_dir):
        with ColocatedVLLM.from_config(
            InferenceConfig(type="vllm", vllm=CONFIG), ModelConfig(), seed=0, run_dir=model_dir.parent
        ) as colocated:
            yield colocated

    @pytest.fixture(scope="module")
    def base_weights(model_dir) -> dict[str, torch.Tensor]:
        return load_file(str(model_dir / "model.safetensors"))

    def sync(engine, weights: dict[str, torch.Tensor], version: int) -> None:
        engine.update_weights(FullWeights.of(weights), version)

    def long_request(seed: int, max_tokens: int = 200) -> InferenceRequest:
        args = GenerationArgs(max_tokens=max_tokens, ignore_eos=True, seed=seed)
        return InferenceRequest(prompt="12 + 34 =", n=2, generation_args=args)

    def test_logprobs_equal_a_forward_pass_before_and_after_each_sync(engine, model_dir, base_weights):
        sync(engine, base_weights, 1)
        assert max_logprob_gap(engine, reference(model_dir, base_weights)) < 1e-5
        for version, seed in ((2, 5), (3, 6)):  # every tensor changes, the embeddings (tied head) too
            weights = perturbed(base_weights, seed)
            sync(engine, weights, version)
            new = reference(model_dir, weights)
            assert max_logprob_gap(engine, new) < 1e-5
            assert max_logprob_gap(engine, new, temperature=0.7, top_k=20, top_p=0.9) < 1e-5
            assert greedy_matches(engine, new)
            assert all(r.policy_version == version for r in engine.generate(long_request(0, 4)))

    def test_the_engine_copies_the_tensors_it_is_handed(engine, model_dir, base_weights):
        weights = {name: t.clone() for name, t in perturbed(base_weights, 7).items()}
        sync(engine, weights, 4)
        for tensor in weights.values():  # the trainer's next update, not synced
            tensor.add_(1.0)
        assert max_logprob_gap(engine, reference(model_dir, perturbed(base_weights, 7))) < 1e-5

    @pytest.mark.parametrize(
        "change, problem",
        [
            (lambda w: w | {"model.norm.weight": torch.ones(7)}, "shape"),
            (lambda w: w | {"model.norm.weight": w["model.norm.weight"] * float("nan")}, "non-finite"),
            (lambda w: w | {"model.no_such.weight": torch.ones(3)}, "no_such"),
            (lambda w: {k: v for k, v in w.items() if "layers.0.mlp" not in k}, "lacks"),
        ],
    )
    def test_a_refused_update_leaves_the_served_weights_and_version(
        engine, model_dir, base_weights, change, problem
    ):
        sync(engine, base_weights, 10)
        with pytest.raises(WeightSyncError, match=problem):
            sync(engine, change(perturbed(base_weights, 8)), 11)
        assert engine.policy_version == 10
        assert max_logprob_gap(engine, reference(model_dir, base_weights)) < 1e-5

    def test_a_sync_waits_for_running_requests_which_finish_on_the_old_weights(
        engine, model_dir, base_weights
    ):
        sync(engine, base_weights, 20)
        future = engine.submit(long_request(3))
        time.sleep(0.3)  # it runs
        new = perturbed(base_weights, 9)
        syncing = threading.Thread(target=sync, args=(engine, new, 21))
        syncing.start()
        responses = future.result(timeout=120)
        syncing.join()
        old = reference(model_dir, base_weights)
        for response in responses:
            assert len(response.token_ids) == 200 and response.policy_version == 20
            expected = reference_logprobs(old, response.prompt_token_ids, response.token_ids)
            assert (expected - torch.tensor(response.logprobs)).abs().max() < 1e-5
        assert max_logprob_gap(engine, reference(model_dir, new)) < 1e-5

    def test_abort_mode_ends_running_requests_at_a_sync(engine, base_weights):
        engine.pause_mode = "abort"
        try:
            future = engine.submit(long_request(4, max_tokens=240))
            time.sleep(0.3)
            sync(engine, base_weights, 30)
            assert {r.finish_reason for r in future.result(timeout=60)} == {"abort"}
        finally:
            engine.pause_mode = "wait"

    def test_a_refused_request_fails_alone_and_continuations_keep_their_ids(engine):
        with pytest.raises(ValueError, match="max_tokens: 400"):
            engine.generate(
                InferenceRequest(prompt="1 + 1 =", generation_args=GenerationArgs(max_tokens=400))
            )
        first = engine.generate(long_request(5, 6))[0]
        ids = first.prompt_token_ids + first.token_ids
        follow = engine.generate(
            InferenceRequest(
                prompt=" 3 + 4 =", prompt_token_ids=ids, generation_args=GenerationArgs(max_tokens=4)
            )
        )[0]
        assert follow.prompt_token_ids[: len(ids)] == ids
        again = engine.generate(long_request(5, 6))[0]
        assert again.token_ids == first.token_ids  # seeded: the same tokens
        # vLLM's detokenised text (with a stop string) equals the text decoded once at the end.
        never = GenerationArgs(max_tokens=6, ignore_eos=True, seed=5, stop=("\u2063",))
        stopped = engine.generate(InferenceRequest(prompt="12 + 34 =", n=2, generation_args=never))[0]
        assert (stopped.token_ids, stopped.text) == (again.token_ids, again.text)

    def test_lora_adapters_are_served_merged_onto_the_base(engine, model_dir, base_weights):
        from llmrl.inference.vllm.colocated import ColocatedAdapters
        from llmrl.weights import AdapterWeights

        adapters = ColocatedAdapters(engine.transport, reference(model_dir, base_weights))
        generator, tensors = torch.Generator().manual_seed(0), {}
        for module in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
            out_features, in_features = base_weights[f"{module}.weight"].shape
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.3 * torch.randn(4, in_features, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.3 * torch.randn(out_features, 4, generator=generator)
        adapter = AdapterWeights(tensors, {"r": 4, "lora_alpha": 8, "peft_type": "LORA"})
        merged = dict(base_weights)
        for layer in adapter.deltas():
            merged |= {name: base_weights[name] + delta for name, delta in layer.items()}
        adapters.send(adapter, 40)
        assert engine.policy_version == 40
        assert max_logprob_gap(engine, reference(model_dir, merged)) < 1e-5
        with pytest.raises(ValueError, match="adapter"):  # a module the model does not have
            adapters.send(
                AdapterWeights({"base_model.model.nowhere.lora_A.weight": torch.ones(4, 2)}, adapter.config),
                41,
            )
        assert engine.policy_version == 40

    def test_a_missing_vllm_is_a_config_error(monkeypatch):
        from llmrl.inference.vllm.colocated import check_colocatable

        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
        with pytest.raises(ConfigError, match="no vllm"):
            check_colocatable(CONFIG)
