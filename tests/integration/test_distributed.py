"""`torchrun --nproc-per-node 2 -m llmrl train` on CPU (gloo, FSDP2) against the same run in one process,
with every weight trained and with LoRA."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from llmrl.telemetry import read_metrics

pytestmark = pytest.mark.slow

STEPS = 4
SETTINGS = [
    f"training.steps={STEPS}",
    "training.prompts_per_step=8",
    "training.lr=1e-4",
    "checkpoint.every=2",
    "checkpoint.keep_last=3",
    "evaluation.at_start=false",
    "evaluation.every=0",
    "evaluation.num_prompts=8",
    "evaluation.samples_per_prompt=2",
    "evaluation.ks=[1, 2]",
    "logging.progress=plain",
    "logging.tensorboard=false",
]


def train(run_dir: Path, processes: int, *overrides: str) -> subprocess.CompletedProcess:
    """`llmrl train` of the test config (plus `overrides`) in `processes` processes (torchrun when more than
    one)."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
        if processes > 1
        else []
    )
    argv = [
        sys.executable,
        *launcher,
        "-m",
        "llmrl",
        "train",
        *[a for s in SETTINGS for a in ("--set", s)],
        "--set",
        f"run_dir={run_dir}",
        *[a for s in overrides for a in ("--set", s)],
    ]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=run_dir.parent, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "terminate called" not in output and "Traceback" not in output, output[-4000:]
    return result


def weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors")


def assert_close_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)


def adapter(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    folder = run_dir / "checkpoints" / f"step_{step:06d}" / "adapter"
    return load_file(folder / "adapter_model.safetensors")


def losses(run_dir: Path) -> list[float]:
    return [row["train/loss"] for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_path) -> dict[int, Path]:
    """The same run in one process and in two: processes -> run folder."""
    root = tmp_path_factory.mktemp("distributed")
    folders = {1: root / "one", 2: root / "two"}
    for processes, folder in folders.items():
        train(folder, processes)
    return folders


def test_two_processes_train_like_one(runs):
    one, two = losses(runs[1]), losses(runs[2])
    assert len(one) == len(two) == STEPS
    assert two == pytest.approx(one, rel=1e-5, abs=1e-7)
    # Real losses, not only the zeros of groups without signal. Any step: with today's tiny model the
    # first step's loss is ~2e-9 (at ratio 1 the zero-mean group advantages can all but cancel); later
    # steps' are not.
    assert max(abs(loss) for loss in one) > 1e-3
    rows = read_metrics(runs[2] / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # rank 0 alone writes the run folder
    assert_close_weights(weights(runs[2]), weights(runs[1]))
    checkpoint = runs[2] / "checkpoints" / f"step_{STEPS:06d}"
    assert sorted(p.name for p in (checkpoint / "sharded").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert not list((runs[2] / "checkpoints").glob(".tmp-*"))


def test_the_exported_folder_loads_with_transformers(runs):
    from transformers import AutoModelForCausalLM

    folder = runs[2] / "checkpoints" / f"step_{STEPS:06d}" / "model"
    model = AutoModelForCausalLM.from_pretrained(folder)
    expected = weights(runs[1])
    loaded = model.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_activation_checkpointing_under_fsdp_trains_like_without(runs, tmp_path):
    checkpointed = tmp_path / "checkpointed"
    train(checkpointed, 2, "training.activation_checkpointing=true")
    assert losses(checkpointed) == pytest.approx(losses(runs[2]), rel=1e-5, abs=1e-7)
    assert_close_weights(weights(checkpointed), weights(runs[2]))


def test_bfloat16_compute_over_float32_master_shards(tmp_path, tiny_model_path):
    """FSDP2 gathers bfloat16 copies for the passes; the shards, gradients and optimizer stay float32,
    the exported folder is bfloat16, and each step logs the measured peak beside the plan."""
    run_dir = tmp_path / "bf16"
    result = train(run_dir, 2, "model.dtype=bfloat16", "training.steps=2")
    assert "memory plan per rank" in result.stdout and "other ranks" in result.stdout
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert all(0 < row["memory/peak_gb"] < 8 and row["memory/plan_gb"] > 0 for row in rows)
    assert all(torch.isfinite(torch.tensor(row["train/loss"])) for row in rows)
    exported = weights(run_dir, 2)
    assert {value.dtype for value in exported.values()} == {torch.bfloat16}
    model_folder = run_dir / "checkpoints" / "step_000002" / "model"
    assert '"dtype": "bfloat16"' in (model_folder / "config.json").read_text()
    metadata = dcp.FileSystemReader(str(model_folder.parent / "sharded")).read_metadata()
    masters = {
        name: entry.properties.dtype
        for name, entry in metadata.state_dict_metadata.items()
        if name.startswith("model.") and hasattr(entry, "properties")
    }
    assert masters and set(masters.values()) == {torch.float32}


@pytest.mark.parametrize(
    ("settings", "optimizer_steps"),
    [
        pytest.param(["training.mini_batches=2"], 2, id="mini-batches"),
        pytest.param(
            ["training.mini_batches=2", "training.iterations=2", "algorithm.kl_beta=0.04"],
            4,
            id="iterations-and-reference-kl",
        ),
    ],
)
def test_old_policy_and_reference_logprobs_match_one_process(
    tmp_path, tiny_model_path, settings, optimizer_steps
):
    """Several optimizer steps per RL step: the pi_old pass (and the sharded reference model's pass, with
    a KL term) is shared out over the ranks and gathered back, then reused by every later update."""
    for processes in (1, 2):
        train(tmp_path / str(processes), processes, "training.steps=2", "checkpoint.every=0", *settings)
    one, two = read_metrics(tmp_path / "1" / "metrics.jsonl"), read_metrics(tmp_path / "2" / "metrics.jsonl")
    for key in ("train/loss", "train/kl", "train/approx_kl", "train/grad_norm", "train/optimizer_steps"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-5, abs=1e-7), key
    assert one[0]["train/optimizer_steps"] == optimizer_steps
    assert all(row["train/kl"] > 1e-4 for row in one)  # the compared KL is real, not zeros


@pytest.mark.parametrize(("written_by", "resumed_by"), [(2, 1), (1, 2)])
def test_resume_with_another_number_of_processes(runs, tmp_path, written_by, resumed_by):
    """A run that stopped after its step-2 checkpoint ends like the uninterrupted one."""
    interrupted = tmp_path / "interrupted"
    shutil.copytree(runs[written_by], interrupted)
    shutil.rmtree(interrupted / "checkpoints" / f"step_{STEPS:06d}")
    result = train(interrupted, resumed_by)
    assert "resuming" in result.stdout and "from its checkpoint at step 2" in result.stdout
    assert_close_weights(weights(interrupted), weights(runs[written_by]))
    assert losses(interrupted) == pytest.approx(losses(runs[written_by]), rel=1e-5, abs=1e-7)


def test_a_torn_shard_sends_every_rank_back_to_the_checkpoint_before(runs, tmp_path):
    """The manifest covers every rank's shards; rank 0 alone checks them and sets the torn checkpoint aside."""
    interrupted = tmp_path / "interrupted"
    shutil.copytree(runs[2], interrupted)
    shards = sorted((interrupted / "checkpoints" / f"step_{STEPS:06d}" / "sharded").glob("*.distcp"))
    os.truncate(shards[-1], shards[-1].stat().st_size // 2)
    result = train(interrupted, 2)
    output = result.stdout + result.stderr
    assert output.count(" is torn (") == 1 and f"(sharded/{shards[-1].name} has " in output
    assert "from its checkpoint at step 2" in result.stdout
    assert (interrupted / "checkpoints" / f"step_{STEPS:06d}.torn").is_dir()
    assert_close_weights(weights(interrupted), weights(runs[2]))


@pytest.mark.parametrize(
    ("signum", "to_every_process", "on_signal"),
    [
        # A terminal sends Ctrl-C to torchrun and every worker (one process group); torchrun forwards it.
        pytest.param(signal.SIGINT, True, "finish_step", id="ctrl-c"),
        # SLURM, Kubernetes and `docker stop` send SIGTERM to torchrun, which forwards it to each worker.
        pytest.param(signal.SIGTERM, False, "finish_step", id="sigterm"),
        # Rank 0 abandons the step if it still waits for its rollouts, and tells the others so.
        pytest.param(signal.SIGTERM, False, "save_now", id="sigterm-save-now"),
    ],
)
def test_a_signal_stops_every_process_after_one_saved_step_and_the_rerun_matches(
    runs, tmp_path, signum, to_every_process, on_signal
):
    run = tmp_path / "run"
    settings = ["checkpoint.every=0", f"checkpoint.on_signal={on_signal}"]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "llmrl",
        "train",
        *[a for s in [*SETTINGS, *settings, f"run_dir={run}"] for a in ("--set", s)],
    ]
    process = subprocess.Popen(
        argv,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or len(read_metrics(run / "metrics.jsonl")) < 1:
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    if to_every_process:
        os.killpg(process.pid, signum)
    else:
        os.kill(process.pid, signum)
    output, _ = process.communicate(timeout=120)
    assert "terminate called" not in output, output[-4000:]
    saved = [int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*")]
    assert len(saved) == 1 and 1 <= saved[0] < STEPS, output[-4000:]
    assert max(row["step"] for row in read_metrics(run / "metrics.jsonl")) == saved[0]
    assert (run / "checkpoints" / f"step_{saved[0]:06d}" / "sharded").is_dir()
    assert not list((run / "checkpoints").glob(".tmp-*"))
    name = signal.Signals(signum).name
    assert f"{name}: stopping" in output or f"{name}: step {saved[0] + 1} abandoned" in output

    result = train(run, 2, *settings)
    assert f"from its checkpoint at step {saved[0]}" in result.stdout
    expected, actual = weights(runs[2]), weights(run)
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key
    assert losses(run) == losses(runs[2])


# The rate: a weight whose gradient is about Adam's epsilon (A's, once B has moved off zero) moves by a
# few percent of the rate more or less on float noise in the gradient; 3e-4 keeps that within 1e-5.
LORA = ["model.lora={rank: 8, alpha: 16}", "training.lr=3e-4", "algorithm.kl_beta=0.05"]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_model_path) -> dict[int, Path]:
    """The same LoRA run (KL reference: adapters off) in one process and in two: processes -> run folder."""
    root = tmp_path_factory.mktemp("distributed-lora")
    folders = {1: root / "one", 2: root / "two"}
    for processes, folder in folders.items():
        train(folder, processes, *LORA)
    return folders


def test_lora_over_two_processes_trains_like_one(lora_runs):
    """The frozen base sharded, the adapters trained, synced and checkpointed (optimizer included) as
    one process does."""
    one, two = (read_metrics(lora_runs[n] / "metrics.jsonl") for n in (1, 2))
    for key in ("train/loss", "train/ref_kl", "train/grad_norm", "train/mismatch_kl", "sync/bytes"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-5, abs=1e-7), key
    assert one[-1]["train/ref_kl"] > 1e-4  # the compared KL against the adapters-off reference is real
    assert all(row["sync/bytes"] == one[0]["sync/bytes"] for row in two)  # the adapters alone
    assert_close_weights(adapter(lora_runs[2]), adapter(lora_runs[1]))
    checkpoint = lora_runs[2] / "checkpoints" / f"step_{STEPS:06d}"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "adapter",
        "config.yaml",
        "manifest.json",
        "trainer_state.pt",
    ]
    optimizers = [
        torch.load(lora_runs[n] / "checkpoints" / f"step_{STEPS:06d}" / "trainer_state.pt")["optimizer"]
        for n in (1, 2)
    ]
    assert optimizers[1]["param_groups"] == optimizers[0]["param_groups"]
    assert optimizers[1]["state"].keys() == optimizers[0]["state"].keys()
    for index, state in optimizers[0]["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(optimizers[1]["state"][index][name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("written_by", "resumed_by"), [(2, 1), (1, 2)])
def test_a_lora_run_resumes_with_another_number_of_processes(lora_runs, tmp_path, written_by, resumed_by):
    """Every rank continues from the step-2 adapter checkpoint (adapters and optimizer state)."""
    interrupted = tmp_path / "interrupted"
    shutil.copytree(lora_runs[written_by], interrupted)
    shutil.rmtree(interrupted / "checkpoints" / f"step_{STEPS:06d}")
    result = train(interrupted, resumed_by, *LORA)
    assert "from its checkpoint at step 2" in result.stdout
    assert_close_weights(adapter(interrupted), adapter(lora_runs[written_by]))
    assert losses(interrupted) == pytest.approx(losses(lora_runs[written_by]), rel=1e-5, abs=1e-7)


def test_lora_over_a_bfloat16_base_trains_float32_adapters(tmp_path, tiny_model_path):
    """Each unit holds a bfloat16 base and float32 adapters; the first pass of the run is the reference's
    (adapters off), after which FSDP2 still reduces the adapters' gradients in float32."""
    run_dir = tmp_path / "bf16"
    train(run_dir, 2, *LORA, "model.dtype=bfloat16", "training.steps=2")
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert all(torch.isfinite(torch.tensor(row["train/loss"])) for row in rows)
    assert rows[-1]["train/ref_kl"] > 0
    assert {value.dtype for value in adapter(run_dir, 2).values()} == {torch.float32}


# Every rank loads the tiny model the way the trainer does, compares its forward pass with an unsharded
# copy, then gathers the weights in buckets of 1 MiB (about one decoder layer of the tiny model).
SHARDED_LOADING_SCRIPT = """
import torch
from llmrl.weights import weight_buckets
from llmrl.models import load_model
from llmrl.models.shape import tied_duplicates
from llmrl.trainer.distributed import Distributed

distributed = Distributed.from_env("cpu")
model, _ = distributed.load_model("tiny://arithmetic", device="cpu")
reference, _ = load_model("tiny://arithmetic")
assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again on the meta-built rank
tied = tied_duplicates(model)
assert tied == tied_duplicates(reference) == {"lm_head.weight"}, tied
ids = torch.tensor([[1, 5, 9, 13, 2, 7, 3, 4], [8, 6, 4, 2, 11, 12, 14, 15]])
with torch.no_grad():
    logprobs = torch.log_softmax(model(input_ids=ids).logits, -1)
    expected = torch.log_softmax(reference(input_ids=ids).logits, -1)
torch.testing.assert_close(logprobs, expected, rtol=1e-6, atol=1e-6)

bound = 1 << 20
buckets = list(distributed.gathered_buckets(model, bound, held_on="cpu" if distributed.is_main else None, skip=tied))
full = {n: t for n, t in reference.state_dict().items() if n not in tied}
sizes = {n: t.numel() * t.element_size() for n, t in full.items()}
assert len(buckets) == len(weight_buckets(list(full), sizes, bound)) > 2
if distributed.is_main:
    assert [n for bucket in buckets for n in bucket] == list(full)  # every tensor once, in order
    layer_bytes = max(sum(s for n, s in sizes.items() if n.startswith(f"model.layers.{i}.")) for i in range(reference.config.num_hidden_layers))
    for bucket in buckets:
        assert sum(t.numel() * t.element_size() for t in bucket.values()) <= max(bound, layer_bytes)
        for name, tensor in bucket.items():
            assert torch.equal(tensor, full[name]), name
else:
    assert all(bucket == {} for bucket in buckets)
print(f"rank {distributed.rank}: sharded loading and bucketed gathering agree with one process")
distributed.close()
"""


def test_meta_built_ranks_compute_like_one_process_and_gather_bounded_buckets(tmp_path, tiny_model_path):
    """Rank 1 builds the model on the meta device and receives its shards (ties and the rotary
    buffers included); the weight sync's buckets hold every tensor once, in order, within the bound."""
    script = tmp_path / "sharded_loading.py"
    script.write_text(SHARDED_LOADING_SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for rank in (0, 1):
        assert f"rank {rank}: sharded loading and bucketed gathering agree with one process" in output, (
            output[-4000:]
        )


# Rank 0 fails and leaves without the barrier; rank 1's barrier then fails for want of its peer.
PEER_FAILED_SCRIPT = """
import torch.distributed as dist
from llmrl.trainer.distributed import Distributed

distributed = Distributed.from_env("cpu")
if distributed.rank == 0:
    distributed.close(wait=False)  # what a failing rank does
else:
    try:
        distributed.close()
    except RuntimeError:
        print("rank 1: the barrier failed")
    print(f"rank 1: process group alive after close: {dist.is_initialized()}")
"""


def test_a_rank_whose_peer_failed_still_leaves_the_process_group(tmp_path):
    """`close` destroys the process group even when its barrier fails: a process that exits with the
    group alive can abort at interpreter shutdown (see `llmrl.trainer.distributed`)."""
    script = tmp_path / "peer_failed.py"
    script.write_text(PEER_FAILED_SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    output = result.stdout + result.stderr
    assert "rank 1: the barrier failed" in output, output[-4000:]
    assert "rank 1: process group alive after close: False" in output, output[-4000:]
    assert "terminate called" not in output, output[-4000:]
