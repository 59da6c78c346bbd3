"""Trainer pieces on their own: batch preparation, the policy update, LR schedules, checkpoints,
and the pure helpers of distributed training."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import re
import zlib
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from llmrl.agents.base import placeholder_rollout
from llmrl.algorithms.logprobs import selective_log_softmax
from llmrl.algorithms.packing import has_local_attention
from llmrl.config import AlgorithmConfig, TrainingConfig
from llmrl.models.loading import enable_activation_checkpointing
from llmrl.models.shape import ModelShape, tied_duplicates
from llmrl.rollouts import RolloutBatch, prepare_batch, rollout_metrics
from llmrl.trainer import checkpoint as ckpt
from llmrl.trainer.distributed import split_by_tokens
from llmrl.trainer.metric_totals import MetricTotals
from llmrl.trainer.optimization import PolicyUpdate, build_optimizer, fast_forward
from llmrl.trainer.passes import sampling_params
from llmrl.types import GenerationArgs, RolloutGroup, TokenRollout

VOCAB = 48


def rollout(
    prompt: list[int], completion: list[int], reward: float, *, env="env", truncated=False
) -> TokenRollout:
    return TokenRollout(
        trajectory=[prompt, completion],
        generation_mask=[[False] * len(prompt), [True] * len(completion)],
        logprobs=[[0.0] * len(prompt), [-1.0] * len(completion)],
        reward=reward,
        env_id=env,
        problem_id=f"p{prompt[0]}",
        truncated=truncated,
    )


def random_groups(num_groups: int, group_size: int, seed: int = 0, env="env") -> list[RolloutGroup]:
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5))]
        rollouts = [
            rollout(
                prompt,
                [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))],
                float(rng.random() < 0.5),
                env=env,
            )
            for _ in range(group_size)
        ]
        groups.append(RolloutGroup(group_id=f"{env}/{g}", rollouts=rollouts))
    return groups


def tiny_policy(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config).float()


def run_update(groups, *, algorithm=None, training=None, seed=0, skip=None, checkpointing=False):
    algorithm = algorithm or AlgorithmConfig()
    training = training or TrainingConfig(lr=0.5, micro_batch_tokens=4096)
    policy = tiny_policy(seed)
    if checkpointing:
        enable_activation_checkpointing(policy)
    # Plain SGD: Adam's first step is about lr * sign(gradient), which would magnify rounding noise.
    optimizer = torch.optim.SGD(policy.parameters(), lr=training.lr)
    update = PolicyUpdate(
        policy,
        optimizer,
        algorithm=algorithm,
        training=training,
        generation_args=GenerationArgs(),
        max_tokens=8,
        pad_token_id=0,
        reference=tiny_policy(seed + 1) if algorithm.kl_beta else None,
    )
    if skip is not None:
        update.skip_zero_advantage = skip
    batch, _ = prepare_batch(groups, group_size=len(groups[0].rollouts), algorithm=algorithm, max_tokens=8)
    metrics = update(batch, torch.Generator().manual_seed(0))
    return policy, metrics


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-6) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=name)


# -- batch preparation ---------------------------------------------------------------------------


def test_prepare_batch_excludes_placeholders_and_gives_them_no_share_of_the_statistics():
    prompt = [1, 2, 3]
    group = RolloutGroup(
        group_id="g",
        rollouts=[
            rollout(prompt, [4], 1.0),
            rollout(prompt, [5], 0.0),
            placeholder_rollout("env", "p1", "boom"),
        ],
    )
    batch, advantages = prepare_batch([group], group_size=3, algorithm=AlgorithmConfig(), max_tokens=8)
    assert len(batch) == 2 and advantages[2] == 0
    assert advantages[0] == pytest.approx(1.0, abs=1e-5) and advantages[1] == pytest.approx(-1.0, abs=1e-5)


def test_mask_truncated_drops_truncated_rollouts_from_the_loss_but_not_from_the_baseline():
    prompt = [1, 2]
    group = RolloutGroup(
        group_id="g",
        rollouts=[
            rollout(prompt, [3] * 8, 0.0, truncated=True),
            rollout(prompt, [4], 1.0),
        ],
    )
    kept, advantages = prepare_batch(
        [group], group_size=2, algorithm=AlgorithmConfig(mask_truncated=True), max_tokens=8
    )
    assert [r.num_generated for r in kept.rollouts] == [1] and advantages[0] < 0 < advantages[1]
    everything, _ = prepare_batch([group], group_size=2, algorithm=AlgorithmConfig(), max_tokens=8)
    assert len(everything) == 2


def test_overlong_penalty_turns_equal_rewards_into_a_length_signal():
    prompt = [1, 2]
    group = RolloutGroup(
        group_id="g", rollouts=[rollout(prompt, [3] * 8, 1.0), rollout(prompt, [4] * 2, 1.0)]
    )
    _, plain = prepare_batch([group], group_size=2, algorithm=AlgorithmConfig(), max_tokens=8)
    shaped_config = AlgorithmConfig(overlong_buffer=4, overlong_penalty=0.5)
    _, shaped = prepare_batch([group], group_size=2, algorithm=shaped_config, max_tokens=8)
    assert plain.tolist() == [0.0, 0.0]
    assert shaped[0] < 0 < shaped[1]


def test_prepare_batch_rejects_groups_of_the_wrong_size():
    with pytest.raises(ValueError, match="expected 4"):
        prepare_batch(random_groups(2, 3), group_size=4, algorithm=AlgorithmConfig(), max_tokens=8)


def test_normalizer_counts_tokens_or_sequences():
    batch = RolloutBatch([rollout([1], [2, 3, 4], 1.0), rollout([1], [5], 0.0)], torch.tensor([1.0, -1.0]))
    assert batch.normalizer([0, 1], "token_mean", 8) == 4
    assert batch.normalizer([0, 1], "seq_mean_token_mean", 8) == 2
    assert batch.normalizer([0, 1], "seq_mean_token_sum_norm", 8) == 16
    assert batch.normalizer([], "token_mean", 8) == 0


def test_rollout_metrics_per_environment():
    groups = random_groups(2, 4, env="a") + random_groups(1, 4, seed=1, env="b")
    _, advantages = prepare_batch(groups, group_size=4, algorithm=AlgorithmConfig(), max_tokens=8)
    metrics = rollout_metrics(groups, advantages, correct_threshold=1.0)
    rewards_a = [r.reward for g in groups[:2] for r in g.rollouts]
    assert metrics["reward/a/mean"] == pytest.approx(sum(rewards_a) / 8)
    assert metrics["reward/mean"] == pytest.approx(sum(r.reward for g in groups for r in g.rollouts) / 12)
    assert metrics["reward/b/pass_rate"] == metrics["reward/b/mean"]  # 0/1 rewards
    lengths = [r.num_generated for g in groups for r in g.rollouts]
    assert metrics["rollout/response_length"] == pytest.approx(sum(lengths) / 12)
    assert metrics["rollout/response_length_max"] == max(lengths)
    assert metrics["rollout/placeholder_frac"] == 0.0


# -- the policy update ---------------------------------------------------------------------------


def test_micro_batch_size_does_not_change_the_update():
    groups = random_groups(4, 4)
    big, big_metrics = run_update(groups, training=TrainingConfig(lr=0.5, micro_batch_tokens=4096))
    layouts = (
        {"micro_batch_tokens": 12},
        {"micro_batch_tokens": 40, "pack_row_tokens": 10},
        {"share_prefixes": False},
    )
    for layout in layouts:
        small, small_metrics = run_update(groups, training=TrainingConfig(lr=0.5, **layout))
        assert_same_weights(big, small)
        assert small_metrics["loss"] == pytest.approx(big_metrics["loss"], abs=1e-6)
        assert big_metrics["num_tokens"] == small_metrics["num_tokens"]


def test_activation_checkpointing_recomputes_each_layer_and_changes_nothing():
    groups = random_groups(4, 4)
    calls = []
    for layout in ({}, {"micro_batch_tokens": 40, "pack_row_tokens": 10}, {"share_prefixes": False}):
        training = TrainingConfig(lr=0.5, **layout)
        plain, plain_metrics = run_update(groups, training=training)
        with count_layer_calls(calls):
            checkpointed, metrics = run_update(groups, training=training, checkpointing=True)
        assert_same_weights(plain, checkpointed)
        assert metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-6)
        # One forward per micro-batch, then one more in the backward pass (the recomputation).
        micro_batches = calls.count("forward") // 2
        assert micro_batches >= 1 and calls.count("forward") == 2 * micro_batches
        calls.clear()


@contextlib.contextmanager
def count_layer_calls(calls: list[str]):
    """Record a "forward" for every call of a Qwen2 decoder layer's forward while the block runs."""
    original = Qwen2DecoderLayer.forward

    def counted(self, *args, **kwargs):
        calls.append("forward")
        return original(self, *args, **kwargs)

    Qwen2DecoderLayer.forward = counted
    try:
        yield
    finally:
        Qwen2DecoderLayer.forward = original


def test_float32_master_weights_keep_updates_that_bfloat16_weights_round_away():
    groups = random_groups(4, 4)
    batch, _ = prepare_batch(groups, group_size=4, algorithm=AlgorithmConfig(), max_tokens=8)
    changed = {}
    for master in (torch.float32, torch.bfloat16):
        policy = tiny_policy().to(master)
        before = [p.detach().clone() for p in policy.parameters()]
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        update = PolicyUpdate(
            policy,
            optimizer,
            algorithm=AlgorithmConfig(),
            training=TrainingConfig(),
            generation_args=GenerationArgs(),
            max_tokens=8,
            pad_token_id=0,
            compute_dtype=torch.bfloat16,
        )
        metrics = update(batch, torch.Generator().manual_seed(0))
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        assert all(p.dtype == master for p in policy.parameters())
        moved = sum(int((p != b).sum()) for p, b in zip(policy.parameters(), before, strict=True))
        changed[master] = moved / sum(b.numel() for b in before)
    # Adam moves every weight with a gradient by about lr; bfloat16 resolves 1e-6 only near zero.
    assert changed[torch.float32] > 0.9
    assert changed[torch.bfloat16] < 0.1


def test_autocast_runs_the_layers_in_the_compute_dtype_and_the_lm_head_in_float32():
    policy = tiny_policy()
    seen = {}
    policy.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.update(layer=o.dtype))
    groups = random_groups(2, 2)
    batch, _ = prepare_batch(groups, group_size=2, algorithm=AlgorithmConfig(), max_tokens=8)
    update = PolicyUpdate(
        policy,
        torch.optim.SGD(policy.parameters(), lr=0.0),
        algorithm=AlgorithmConfig(),
        training=TrainingConfig(),
        generation_args=GenerationArgs(),
        max_tokens=8,
        pad_token_id=0,
        compute_dtype=torch.bfloat16,
    )
    logits_dtypes = []
    original = torch.nn.functional.linear

    def recording_linear(x, weight, bias=None):
        out = original(x, weight, bias)
        if weight is policy.lm_head.weight:
            logits_dtypes.append(out.dtype)
        return out

    torch.nn.functional.linear = recording_linear
    try:
        update(batch, torch.Generator().manual_seed(0))
    finally:
        torch.nn.functional.linear = original
    assert seen["layer"] == torch.bfloat16
    assert logits_dtypes and set(logits_dtypes) == {torch.float32}


def test_micro_batches_respect_the_token_budget_and_the_row_length():
    groups = random_groups(6, 4)
    batch, _ = prepare_batch(groups, group_size=4, algorithm=AlgorithmConfig(), max_tokens=8)
    training = TrainingConfig(micro_batch_tokens=40, pack_row_tokens=10)
    update = PolicyUpdate(
        tiny_policy(),
        None,
        algorithm=AlgorithmConfig(),
        training=training,
        generation_args=GenerationArgs(),
        max_tokens=8,
        pad_token_id=0,
    )
    packed = list(update.passes.micro_batches(batch.sequences, batch.loss_masks, range(len(batch))))
    longest = max(len(s) for s in batch.sequences)
    assert all(p.input_ids.numel() <= 40 and p.input_ids.shape[1] <= max(10, longest) for p in packed)
    assert sorted(i for p in packed for i in p.spans) == list(range(len(batch)))
    # Rollouts of one prompt share it: fewer tokens than the rollouts hold.
    assert sum(p.num_tokens for p in packed) < sum(len(s) for s in batch.sequences)


def test_the_forward_flops_count_the_layers_and_the_attention_width():
    policy = tiny_policy()  # 2 layers, hidden 32, 4 heads of 8, input and output embeddings 48 x 32 each
    assert not policy.config.tie_word_embeddings
    shape = ModelShape.of(policy)
    token_cost, pair_cost = shape.token_flops, shape.pair_flops
    embedding_weights = 2 * VOCAB * 32
    assert token_cost == 2 * (sum(p.numel() for p in policy.parameters()) - embedding_weights)
    assert pair_cost == 4 * 2 * 4 * 8


def test_models_with_sliding_window_attention_never_share_prefixes():
    from transformers import MistralConfig

    assert not has_local_attention(Qwen2Config())
    assert has_local_attention(MistralConfig(sliding_window=4096))
    assert has_local_attention(
        Qwen2Config(layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2)
    )
    groups = random_groups(3, 4)
    batch, _ = prepare_batch(groups, group_size=4, algorithm=AlgorithmConfig(), max_tokens=8)

    def layouts(policy):
        update = PolicyUpdate(
            policy,
            None,
            algorithm=AlgorithmConfig(),
            training=TrainingConfig(),
            generation_args=GenerationArgs(),
            max_tokens=8,
            pad_token_id=0,
        )
        return list(update.passes.micro_batches(batch.sequences, batch.loss_masks, range(len(batch))))

    assert any(p.attention_mask is not None for p in layouts(tiny_policy()))  # shared when it may
    local = tiny_policy()
    local.config.layer_types = ["sliding_attention", "full_attention"]
    packed = layouts(local)
    assert all(p.attention_mask is None for p in packed)
    assert sum(p.num_tokens for p in packed) == sum(len(s) for s in batch.sequences)


def test_skipping_zero_advantage_rollouts_does_not_change_the_update():
    groups = random_groups(4, 4)
    groups[0] = RolloutGroup(
        group_id="equal",
        rollouts=[
            rollout([7, 8], [9, 10], 1.0),
            rollout([7, 8], [11], 1.0),
            rollout([7, 8], [12], 1.0),
            rollout([7, 8], [9], 1.0),
        ],
    )
    skipped, skipped_metrics = run_update(groups, skip=True)
    full, full_metrics = run_update(groups, skip=False)
    assert_same_weights(skipped, full)
    assert skipped_metrics["loss"] == pytest.approx(full_metrics["loss"], abs=1e-6)
    assert skipped_metrics["num_sequences"] < full_metrics["num_sequences"]


@pytest.mark.parametrize("mini_batches", [1, 2])  # 2: pi_old needs a pass of its own, over nothing
def test_a_step_without_signal_leaves_the_weights_alone(mini_batches):
    groups = [
        RolloutGroup(group_id=f"equal{g}", rollouts=[rollout([1, 2], [3], 1.0), rollout([1, 2], [4], 1.0)])
        for g in range(2)
    ]
    policy, metrics = run_update(groups, training=TrainingConfig(lr=0.5, mini_batches=mini_batches))
    assert_same_weights(policy, tiny_policy(0), atol=0)
    assert metrics["skipped_updates"] == mini_batches and metrics["optimizer_steps"] == 0


def test_single_pass_ratio_is_one_and_extra_passes_move_it():
    groups = random_groups(4, 4)
    _, one = run_update(groups)
    assert one["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and one["approx_kl"] == pytest.approx(
        0.0, abs=1e-9
    )
    _, several = run_update(groups, training=TrainingConfig(lr=0.5, iterations=2, mini_batches=2))
    assert several["optimizer_steps"] == 4
    assert several["approx_kl"] > 0  # later mini-batches see a policy that moved since pi_old


def test_gradient_matches_the_plain_formula():
    """One rollout, advantage a, one pass: the loss gradient is -a * grad(sum logprob) / tokens."""
    groups = [RolloutGroup(group_id="g", rollouts=[rollout([1, 2], [3, 4], 1.0), rollout([1, 2], [5], 0.0)])]
    training = TrainingConfig(lr=0.5, max_grad_norm=None)
    trained, _ = run_update(groups, training=training)
    reference = tiny_policy(0)
    batch, _ = prepare_batch(groups, group_size=2, algorithm=AlgorithmConfig(), max_tokens=8)
    loss = 0.0
    for r, advantage in zip(batch.rollouts, batch.advantages, strict=True):
        ids = torch.tensor([r.tokens])
        logprobs = torch.log_softmax(reference(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[
            :, 0
        ]
        mask = torch.tensor(r.mask[1:])
        loss = loss - advantage * logprobs[mask].sum()
    (loss / 3).backward()  # token_mean over the 3 completion tokens
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert_same_weights(trained, reference, atol=1e-5)


def test_kl_penalty_uses_the_reference_model():
    groups = random_groups(2, 4)
    _, metrics = run_update(groups, algorithm=AlgorithmConfig(kl_beta=0.1))
    assert metrics["ref_kl"] > 0  # a differently initialised reference


def test_rollout_longer_than_the_micro_batch_budget_is_a_clear_error():
    groups = [
        RolloutGroup(group_id="g", rollouts=[rollout([1] * 10, [3] * 5, 1.0), rollout([1] * 10, [4], 0.0)])
    ]
    with pytest.raises(ValueError, match=r"training.micro_batch_tokens: a rollout of 15 tokens"):
        run_update(groups, training=TrainingConfig(lr=0.5, micro_batch_tokens=12))


def hand_written_lr_factor(step: int, training: TrainingConfig) -> float:
    """The schedule as llmrl wrote it before it used torch's schedulers: the reference they must match."""
    if step < training.warmup_steps:
        return (step + 1) / training.warmup_steps
    progress = min((step - training.warmup_steps) / max(training.steps - training.warmup_steps, 1), 1.0)
    return {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[
        training.lr_schedule
    ]


def schedule_lrs(
    training: TrainingConfig, steps: int, *, resume_at: int | None = None, with_optimizer_state: bool = False
) -> list[float]:
    """The learning rate of steps 0..steps-1 under `build_optimizer`'s schedule; with `resume_at`, the
    schedule
    is rebuilt there from the step, after loading the optimizer's saved state when `with_optimizer_state`
    (as a resume from a checkpoint does; the state carries the rate it was saved with)."""
    optimizer, schedule = build_optimizer(torch.nn.Linear(2, 2), training)
    lrs = []
    for step in range(steps):
        if step == resume_at:
            saved = optimizer.state_dict()
            optimizer, schedule = build_optimizer(torch.nn.Linear(2, 2), training)
            if with_optimizer_state:
                optimizer.load_state_dict(saved)
            fast_forward(schedule, step)
        lrs.append(schedule.get_last_lr()[0])
        assert optimizer.param_groups[0]["lr"] == lrs[-1]
        optimizer.step()
        schedule.step()
    return lrs


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("steps", "warmup_steps"), [(5, 2), (10, 0), (6, 1), (4, 4), (3, 5), (50, 7)])
def test_lr_schedules_follow_the_hand_written_curves(schedule, steps, warmup_steps):
    training = TrainingConfig(lr=0.5, steps=steps, warmup_steps=warmup_steps, lr_schedule=schedule)
    expected = [0.5 * hand_written_lr_factor(step, training) for step in range(steps + 1)]
    assert schedule_lrs(training, steps + 1) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_lr_schedule_resumes_from_the_step_alone():
    """A resumed run rebuilds the schedule and steps it to the checkpoint's step: the same rates bit for bit,
    whether or not the optimizer's state (and with it the rate it was saved at) was loaded first."""
    for schedule in ("constant", "linear", "cosine"):
        training = TrainingConfig(lr=0.5, steps=8, warmup_steps=3, lr_schedule=schedule)
        whole = schedule_lrs(training, 8)
        for with_state in (False, True):
            resumed = [
                schedule_lrs(training, 8, resume_at=step, with_optimizer_state=with_state)
                for step in range(8)
            ]
            assert all(lrs == whole for lrs in resumed), (schedule, with_state)


# -- checkpoints ---------------------------------------------------------------------------------


class FakeTokenizer:
    def save_pretrained(self, folder):
        (folder / "tokenizer.json").write_text("{}")


def save(run_dir, step, keep_last=2, **state):
    return ckpt.save_checkpoint(
        run_dir,
        step,
        model=tiny_policy(),
        tokenizer=FakeTokenizer(),
        trainer_state={"step": step, **state},
        config_yaml="seed: 0\n",
        keep_last=keep_last,
    )


def test_checkpoints_keep_the_last_k_and_ignore_half_written_ones(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    torn = tmp_path / "checkpoints" / "step_000004"
    torn.mkdir()  # a folder without trainer state is not a checkpoint
    (tmp_path / "checkpoints" / ".tmp-step_000005-1").mkdir()
    step, folder = ckpt.latest_checkpoint(tmp_path)
    assert step == 3 and ckpt.load_trainer_state(folder)["step"] == 3
    assert (folder / "model" / "model.safetensors").is_file() and (folder / "config.yaml").is_file()
    save(tmp_path, 5)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert ckpt.latest_checkpoint(tmp_path)[1] == tmp_path / "checkpoints" / "step_000005"
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        ckpt.load_trainer_state(torn)


def test_a_checkpoints_manifest_records_every_other_file(tmp_path):
    folder = save(tmp_path, 1)
    recorded = json.loads((folder / ckpt.MANIFEST).read_text())["files"]
    on_disk = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    assert set(recorded) == set(on_disk) - {ckpt.MANIFEST}
    assert {"trainer_state.pt", "config.yaml", "model/model.safetensors"} <= set(recorded)
    for name, entry in recorded.items():
        assert entry == {
            "bytes": on_disk[name].stat().st_size,
            "crc32": f"{zlib.crc32(on_disk[name].read_bytes()):08x}",
        }


def _truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def _flip_a_byte(path):
    """The same size, another content (written anew and renamed over the file, as a copy would)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    written = path.with_name(f"{path.name}.new")
    written.write_bytes(bytes(data))
    os.replace(written, path)


@pytest.mark.parametrize(
    ("name", "tear", "problem"),
    [
        ("trainer_state.pt", _truncate, r"trainer_state.pt has [\d,]+ bytes, its manifest says [\d,]+"),
        ("model/model.safetensors", _truncate, "model/model.safetensors has"),
        (
            "model/model.safetensors",
            _flip_a_byte,
            "model/model.safetensors does not match its manifest's CRC-32",
        ),
        ("config.yaml", Path.unlink, "config.yaml is missing"),
        ("manifest.json", lambda path: path.write_text('{"files": '), "manifest.json is unreadable"),
    ],
)
def test_a_torn_newest_checkpoint_is_named_set_aside_and_the_previous_one_taken(
    tmp_path, caplog, name, tear, problem
):
    save(tmp_path, 2)
    newest = save(tmp_path, 3)
    ckpt.latest_checkpoint(tmp_path)  # checked once intact: the file's later state is read anew
    tear(newest / name)
    with caplog.at_level("WARNING", logger=ckpt.__name__):
        assert ckpt.latest_checkpoint(tmp_path) == (2, tmp_path / "checkpoints" / "step_000002")
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith(f"checkpoint {newest} is torn (") and line.endswith(
        "set aside as step_000003.torn"
    )
    assert re.search(problem, line) and "\n" not in line
    aside = tmp_path / "checkpoints" / "step_000003.torn"
    assert aside.is_dir() and not newest.exists()  # kept, files and all, for whoever may recover them
    # Pruning leaves it too, and a run that saves step 3 again gets the name back.
    save(tmp_path, 3, keep_last=1)
    save(tmp_path, 4, keep_last=1)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4] and aside.is_dir()


def test_no_complete_checkpoint_left_says_so_in_one_line_every_time(tmp_path, caplog):
    for step in (1, 2):
        _truncate(save(tmp_path, step) / "trainer_state.pt")
    for _ in range(2):  # set aside by the first look, still refused by the next
        with pytest.raises(ckpt.NoCompleteCheckpointError) as refusal:
            ckpt.latest_checkpoint(tmp_path)
        message = str(refusal.value)
        assert "\n" not in message and "has no complete checkpoint" in message
        assert "step_000001.torn, step_000002.torn" in message and "from step 0" in message
    assert len(caplog.records) == 2  # each torn one named once, when it was set aside


def test_a_checkpoint_written_before_manifests_is_trusted(tmp_path):
    folder = save(tmp_path, 1)
    (folder / ckpt.MANIFEST).unlink()
    assert ckpt.latest_checkpoint(tmp_path) == (1, folder)
    assert ckpt.checkpoint_problem(folder) is None


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    random.seed(3)
    torch.manual_seed(3)
    state = ckpt.rng_state()
    expected = (random.random(), torch.rand(3))
    folder = save(tmp_path, 1, rng=state)
    random.seed(99)
    torch.manual_seed(99)
    ckpt.set_rng_state(ckpt.load_trainer_state(folder)["rng"])
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])


def test_optimizer_state_survives_a_checkpoint(tmp_path):
    policy = tiny_policy()
    optimizer, _ = build_optimizer(policy, TrainingConfig(lr=1e-3))
    policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    folder = save(tmp_path, 1, optimizer=optimizer.state_dict())
    restored, _ = build_optimizer(copy.deepcopy(policy), TrainingConfig(lr=1e-3))
    restored.load_state_dict(ckpt.load_trainer_state(folder)["optimizer"])
    state = restored.state_dict()["state"][0]
    assert torch.equal(state["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert not math.isnan(float(state["step"]))


def test_a_checkpoint_exports_the_compute_dtype_and_keeps_the_master_weights(tmp_path):
    policy = tiny_policy()
    folder = ckpt.save_checkpoint(
        tmp_path,
        1,
        model=policy,
        tokenizer=FakeTokenizer(),
        trainer_state={},
        config_yaml="",
        keep_last=1,
        dtype=torch.bfloat16,
    )
    exported = Qwen2ForCausalLM.from_pretrained(folder / "model", dtype="auto")
    assert exported.dtype == torch.bfloat16  # what vLLM and transformers load by default
    torch.testing.assert_close(
        exported.lm_head.weight, policy.lm_head.weight.to(torch.bfloat16), rtol=0, atol=0
    )
    restored = Qwen2ForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)
    assert not torch.equal(restored.lm_head.weight, policy.lm_head.weight)  # rounded through bfloat16
    ckpt.load_master_weights(folder, restored)
    assert_same_weights(restored, policy, atol=0)
    # Weights already in the compute dtype are not written twice.
    same = ckpt.save_checkpoint(
        tmp_path,
        2,
        model=policy,
        tokenizer=FakeTokenizer(),
        trainer_state={},
        config_yaml="",
        keep_last=1,
        dtype=torch.float32,
    )
    assert not (same / ckpt.MASTER_WEIGHTS).exists()


def test_sharded_state_resumes_in_one_process(tmp_path):
    """What a multi-process run writes with torch.distributed.checkpoint loads without a process group."""
    policy = tiny_policy()
    optimizer, _ = build_optimizer(policy, TrainingConfig(lr=1e-3))
    policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    ckpt.save_sharded(tmp_path, policy, optimizer)
    assert ckpt.has_sharded_state(tmp_path)
    restored = tiny_policy(seed=1)
    restored_optimizer, _ = build_optimizer(restored, TrainingConfig(lr=1e-3))
    assert ckpt.load_optimizer(
        tmp_path, {"sharded_optimizer": True}, restored, restored_optimizer, sharded_model=False
    )
    assert_same_weights(restored, policy, atol=0)
    expected, actual = optimizer.state_dict()["state"], restored_optimizer.state_dict()["state"]
    assert torch.equal(actual[0]["exp_avg"], expected[0]["exp_avg"]) and float(actual[0]["step"]) == 1.0


def test_load_optimizer_reports_a_checkpoint_without_one(tmp_path):
    policy = tiny_policy()
    optimizer, _ = build_optimizer(policy, TrainingConfig(lr=1e-3))
    assert not ckpt.load_optimizer(tmp_path, {}, policy, optimizer, sharded_model=False)


# -- distributed helpers -------------------------------------------------------------------------


def test_split_by_tokens_balances_and_keeps_every_position_once():
    lengths = [50, 10, 10, 10, 10, 10, 40, 5]
    shares = split_by_tokens(lengths, 2)
    assert sorted(p for share in shares for p in share) == list(range(len(lengths)))
    assert all(share == sorted(share) for share in shares)
    totals = [sum(lengths[p] for p in share) for share in shares]
    assert max(totals) - min(totals) <= max(lengths)
    assert totals == [75, 70]
    assert split_by_tokens(lengths, 2) == shares  # deterministic: every rank computes the same split
    assert split_by_tokens([7], 3) == [[0], [], []]
    assert split_by_tokens([], 2) == [[], []]


def test_metric_totals_of_shares_combine_into_the_totals_of_the_whole():
    micro_batches = [
        {
            "loss": 0.5,
            "pg_loss": 0.4,
            "entropy": 1.0,
            "is_weight_max": 1.5,
            "num_tokens": 10.0,
            "num_sequences": 2.0,
        },
        {
            "loss": -0.25,
            "pg_loss": -0.2,
            "entropy": 3.0,
            "is_weight_max": 2.0,
            "num_tokens": 30.0,
            "num_sequences": 3.0,
        },
        {
            "loss": 0.125,
            "pg_loss": 0.1,
            "entropy": 2.0,
            "is_weight_max": 1.0,
            "num_tokens": 20.0,
            "num_sequences": 1.0,
        },
    ]
    whole = MetricTotals()
    shares = [MetricTotals(), MetricTotals()]
    for step in range(2):  # two optimizer steps; the micro-batches split between two ranks
        for k, metrics in enumerate(micro_batches):
            whole.add_micro_batch(metrics)
            shares[k % 2].add_micro_batch(metrics)
        for totals in (whole, *shares):
            totals.add_optimizer_step(grad_norm=1.0 + step)
    combined = MetricTotals.combine(shares).result()
    expected = whole.result()
    assert combined.keys() == expected.keys()
    for key, value in expected.items():
        assert combined[key] == pytest.approx(value, rel=1e-12), key
    assert combined["loss"] == pytest.approx(0.375) and combined["grad_norm"] == pytest.approx(1.5)


def test_tied_duplicates_names_the_aliases_of_tied_embeddings():
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    assert tied_duplicates(Qwen2ForCausalLM(config)) == {"lm_head.weight"}
    assert tied_duplicates(tiny_policy()) == set()


def test_each_rollout_gets_logprobs_of_its_own_sampling_options():
    """Rollouts of one packed batch sampled differently (temperature, filters) each get the logprobs
    of their own distribution, the same as a forward pass of that rollout alone."""
    options = [
        GenerationArgs(temperature=0.5, top_k=5),
        GenerationArgs(),
        GenerationArgs(temperature=1.5, min_p=0.05),
        GenerationArgs(temperature=0.8, top_p=0.6),
    ]
    groups = random_groups(4, 2, seed=3)
    for group, args in zip(groups, options, strict=True):
        group.rollouts[:] = [r.model_copy(update={"generation_args": args}) for r in group.rollouts]
    batch, _ = prepare_batch(groups, group_size=2, algorithm=AlgorithmConfig(), max_tokens=8)
    policy = tiny_policy()
    update = PolicyUpdate(
        policy,
        None,
        algorithm=AlgorithmConfig(),
        training=TrainingConfig(micro_batch_tokens=4096),
        generation_args=GenerationArgs(),
        max_tokens=8,
        pad_token_id=0,
    )
    update.passes.follow_sampling([r.generation_args for r in batch.rollouts], ["r"] * len(batch))
    packed = update.passes.sequence_logprobs(policy, batch.sequences, batch.loss_masks, range(len(batch)))
    for i, rollout in enumerate(batch.rollouts):
        tokens, mask = torch.tensor(rollout.tokens), torch.tensor(rollout.mask)
        with torch.no_grad():
            logits = policy(tokens[None]).logits[0, :-1]
        alone = sampling_params([rollout.generation_args] * (len(tokens) - 1), ["r"] * (len(tokens) - 1))
        expected, _ = selective_log_softmax(logits, tokens[1:], alone)
        torch.testing.assert_close(packed[i][mask], expected[mask[1:]], rtol=0, atol=2e-5)


def test_sampling_params_are_one_temperature_when_all_rollouts_agree_and_refuse_what_the_trainer_cannot_follow():
    assert sampling_params([GenerationArgs(temperature=0.7)] * 3, ["a", "b", "c"]) == 0.7
    mixed = sampling_params([GenerationArgs(temperature=0.7), GenerationArgs(top_p=0.9)], ["a", "b"])
    assert (
        mixed.temperature.tolist() == pytest.approx([0.7, 1.0])
        and mixed.top_k is None
        and mixed.min_p is None
    )
    assert mixed.top_p.tolist() == pytest.approx([1.0, 0.9])
    with pytest.raises(
        ValueError, match=r"math problem 3 was sampled with \{'repetition_penalty': 1.2\}.*evaluation_only"
    ):
        sampling_params([GenerationArgs(), GenerationArgs(repetition_penalty=1.2)], ["a", "math problem 3"])
    with pytest.raises(ValueError, match="decoded greedily"):
        sampling_params([GenerationArgs(temperature=0)], ["a"])


def test_a_checkpoint_saved_with_the_old_vllm_bucket_setting_resumes_without_resume(tmp_path):
    import yaml

    from llmrl.config import config_from_dict, dump_config
    from llmrl.trainer import checkpoint as ckpt

    config = config_from_dict({"environments": [{"agent_type": "arithmetic"}], "run_dir": str(tmp_path)})
    saved = yaml.safe_load(dump_config(config))
    saved["inference"]["vllm"]["bucket_mb"] = 512  # as every config.yaml written before the rename holds it
    folder = ckpt.checkpoints_dir(tmp_path) / "step_3"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(saved))
    (folder / ckpt.TRAINER_STATE).write_text("")
    assert ckpt.checkpoint_to_resume(config, force=False) == (3, folder)
    assert config_from_dict(saved).inference.weight_sync_bucket_mb == 512  # and the saved file itself loads
