"""llmrl's GRPO update equals TRL 1.16's on the same rollouts.

TRL's real `GRPOTrainer` trains on fixed rollouts: its generation is replaced through its
`rollout_func` hook (prompt and completion token ids), and a reward function returns fixed rewards,
so TRL computes the advantages, old logprobs, loss, gradients and AdamW step itself. llmrl's own
update path (`prepare_batch` then `PolicyUpdate`) trains a copy of the same policy on the same
rollouts, configured as the TRL table in docs/agents.md says. For every TRL loss normaliser
(`loss_type`), reward scaling (`scale_rewards`) and KL weight (`beta` 0 and > 0) both must give
the same advantages, loss, clipped gradients and weights after the optimizer step; a second case
takes two optimizer steps on one generation (`num_iterations=2`), where the ratio leaves 1 and the
clip range acts.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import GRPOConfig, GRPOTrainer  # the dev extra installs it: without it this test must fail, not skip

from llmrl.config import AlgorithmConfig, TrainingConfig
from llmrl.rollouts import prepare_batch
from llmrl.trainer.optimization import PolicyUpdate, build_optimizer
from llmrl.types import GenerationArgs, RolloutGroup, TokenRollout

pytestmark = pytest.mark.slow

VOCAB = 48
PAD, UNK, EOS = 0, 1, 2
PROMPTS, GROUP_SIZE, MAX_COMPLETION = 3, 4, 8
# Group 0: binary; group 1: continuous; group 2: all equal (no signal: advantage 0 however scaled).
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.3, 0.9, 0.1, 0.6, 0.5, 0.5, 0.5, 0.5]

# What gives each TRL setting's number in llmrl (the docs/agents.md table).
AGGREGATION_OF_LOSS_TYPE = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",  # TRL's bnpo averages each micro-batch; equal with one (gradient_accumulation_steps=1)
    "dapo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",  # max_length: TRL's max_completion_length
}
ADVANTAGES_OF_SCALE_REWARDS = {
    "group": {"advantage_estimator": "grpo", "advantage_std_ddof": 1, "advantage_eps": 1e-4},
    "batch": {
        "advantage_estimator": "grpo",
        "advantage_std_scope": "batch",
        "advantage_std_ddof": 1,
        "advantage_eps": 1e-4,
    },
    "none": {"advantage_estimator": "dr_grpo"},
}


@dataclass(frozen=True)
class Rollouts:
    """Fixed rollouts: prompt ids per group, completion ids per rollout (groups contiguous)."""

    prompts: list[list[int]]
    completions: list[list[int]]


def fixed_rollouts(seed: int = 0) -> Rollouts:
    """Prompts of different lengths (TRL pads them on the left), completions of 1 to MAX_COMPLETION
    tokens (padded on the right), some ending in eos and some cut off at the limit."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6))] for _ in range(PROMPTS)]
    completions = []
    for i in range(PROMPTS * GROUP_SIZE):
        length = MAX_COMPLETION if i % 3 == 0 else rng.randint(1, MAX_COMPLETION - 1)
        body = [rng.randrange(3, VOCAB) for _ in range(length)]
        completions.append(body if length == MAX_COMPLETION else body[:-1] + [EOS])
    return Rollouts(prompts, completions)


def save_reference(folder: Path) -> Path:
    """A small random Qwen2 and a word-level tokenizer over its vocabulary, saved like a checkpoint."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token=f"t{UNK}"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token=f"t{PAD}", unk_token=f"t{UNK}", eos_token=f"t{EOS}"
    )
    tokenizer.save_pretrained(folder)
    return folder


def perturbed_policy(reference_dir: Path) -> transformers.PreTrainedModel:
    """The reference's weights plus noise, so that the KL term and its gradient are not zero."""
    policy = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return policy


@dataclass
class Update:
    """What one framework's update produced."""

    advantages: torch.Tensor  # per rollout, groups contiguous
    losses: list[float]  # per optimizer step
    grad_norms: list[float]  # before clipping, per optimizer step
    gradients: list[dict[str, torch.Tensor]]  # after clipping, before each optimizer step
    weights: dict[str, torch.Tensor]  # after the last optimizer step


def trl_update(
    policy: torch.nn.Module,
    reference_dir: Path,
    rollouts: Rollouts,
    out: Path,
    *,
    loss_type: str,
    scale_rewards: str,
    beta: float,
    use_bias_correction_kl: bool,
    num_iterations: int,
    epsilon_high: float,
    lr: float,
) -> Update:
    """One generation through TRL's GRPOTrainer, its sampling replaced by `rollouts`."""
    prompt_texts = [f"prompt {g}" for g in range(PROMPTS)]
    records: dict[str, Any] = {"losses": [], "gradients": []}

    def fixed_generation(prompts: list[str], trainer: GRPOTrainer) -> dict[str, list]:
        expected = [text for text in prompt_texts for _ in range(GROUP_SIZE)]
        assert prompts == expected, "TRL asked for other prompts than the fixed rollouts answer"
        return {
            "prompt_ids": [rollouts.prompts[i // GROUP_SIZE] for i in range(len(prompts))],
            "completion_ids": rollouts.completions,
            "logprobs": None,
        }

    def fixed_rewards(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        assert len(completions) == len(REWARDS)
        return REWARDS

    class RecordingGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            output = super()._generate_and_score_completions(inputs)
            records["advantages"] = output["advantages"].detach().clone()  # before TRL shuffles the rows
            return output

        def compute_loss(
            self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
        ):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            records["losses"].append(loss.item())
            return loss

    class GradientRecorder(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            records["gradients"].append({n: p.grad.detach().clone() for n, p in policy.named_parameters()})

    config = GRPOConfig(
        output_dir=str(out),
        max_steps=num_iterations,
        per_device_train_batch_size=PROMPTS * GROUP_SIZE,
        gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE,
        num_iterations=num_iterations,
        shuffle_dataset=False,
        max_completion_length=MAX_COMPLETION,
        temperature=1.0,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        beta=beta,
        use_bias_correction_kl=use_bias_correction_kl,
        epsilon=0.2,
        epsilon_high=epsilon_high,
        loss_type=loss_type,
        scale_rewards=scale_rewards,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )
    trainer = RecordingGRPOTrainer(
        model=policy,
        reward_funcs=fixed_rewards,
        args=config,
        train_dataset=datasets.Dataset.from_list([{"prompt": text} for text in prompt_texts]),
        processing_class=transformers.AutoTokenizer.from_pretrained(reference_dir),
        rollout_func=fixed_generation,
        callbacks=[GradientRecorder()],
    )
    trainer.train()
    weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
    grad_norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    return Update(records["advantages"], records["losses"], grad_norms, records["gradients"], weights)


def llmrl_update(
    policy: torch.nn.Module,
    reference_dir: Path,
    rollouts: Rollouts,
    *,
    loss_type: str,
    scale_rewards: str,
    beta: float,
    use_bias_correction_kl: bool,
    num_iterations: int,
    epsilon_high: float,
    lr: float,
) -> tuple[Update, dict[str, float]]:
    """llmrl's update path on the same rollouts, configured as TRL's settings map; and its metrics."""
    algorithm = AlgorithmConfig(
        **ADVANTAGES_OF_SCALE_REWARDS[scale_rewards],
        aggregation=AGGREGATION_OF_LOSS_TYPE[loss_type],
        kl_beta=beta,
        kl_estimator="k3",
        kl_ratio_weighted=use_bias_correction_kl,
        clip_low=0.2,
        clip_high=epsilon_high,
    )
    training = TrainingConfig(lr=lr, max_grad_norm=1.0, iterations=num_iterations)
    groups = [
        RolloutGroup(
            group_id=f"g{g}",
            rollouts=[
                TokenRollout(
                    trajectory=[rollouts.prompts[g], completion],
                    generation_mask=[[False] * len(rollouts.prompts[g]), [True] * len(completion)],
                    reward=REWARDS[i],
                    env_id="fixed",
                    problem_id=f"p{g}",
                    truncated=completion[-1] != EOS,
                )
                for i, completion in enumerate(rollouts.completions)
                if i // GROUP_SIZE == g
            ],
        )
        for g in range(PROMPTS)
    ]
    batch, advantages = prepare_batch(
        groups, group_size=GROUP_SIZE, algorithm=algorithm, max_tokens=MAX_COMPLETION
    )
    reference = (
        transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
        if beta
        else None
    )
    optimizer, _ = build_optimizer(policy, training)
    gradients: list[dict[str, torch.Tensor]] = []

    def record_step(*_: Any) -> None:  # the optimizer step's pre-hook: the gradients are clipped by now
        gradients.append({n: p.grad.detach().clone() for n, p in policy.named_parameters()})

    optimizer.register_step_pre_hook(record_step)
    update = PolicyUpdate(
        policy,
        optimizer,
        algorithm=algorithm,
        training=training,
        generation_args=GenerationArgs(temperature=1.0),
        max_tokens=MAX_COMPLETION,
        pad_token_id=PAD,
        reference=reference,
    )
    metrics = update(batch, torch.Generator().manual_seed(0))
    weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
    # llmrl reports the mean loss and gradient norm over the optimizer steps
    return Update(advantages, [metrics["loss"]], [metrics["grad_norm"]], gradients, weights), metrics


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_reference(tmp_path_factory.mktemp("trl_parity") / "reference")


def assert_same_update(
    trl: Update, ours: Update, initial: dict[str, torch.Tensor], lr: float, steps: int
) -> None:
    torch.testing.assert_close(ours.advantages, trl.advantages, rtol=1e-5, atol=1e-6, msg="advantages")
    trl_loss = sum(trl.losses) / len(trl.losses)
    assert ours.losses[0] == pytest.approx(trl_loss, rel=1e-5, abs=1e-7), "loss"
    # The gradients below are compared after clipping, which would hide a scale; the norms before it show it.
    trl_norm = sum(trl.grad_norms) / len(trl.grad_norms)
    assert len(trl.grad_norms) == steps and ours.grad_norms[0] == pytest.approx(trl_norm, rel=1e-5), (
        "grad norm"
    )
    assert len(trl.gradients) == len(ours.gradients) == steps
    for step, (trl_step, our_step) in enumerate(zip(trl.gradients, ours.gradients, strict=True)):
        assert trl_step.keys() == our_step.keys()
        for name, gradient in trl_step.items():
            # An element summed over many tokens can cancel to near 0 and keep the rounding of the terms
            # it summed, which is the tensor's scale: absolute noise relative to the largest element
            # (6e-7 of 0.035 in the embedding's gradient on a CPU with AVX-512 and AMX).
            scale = float(gradient.abs().max())
            torch.testing.assert_close(
                our_step[name], gradient, rtol=1e-4, atol=1e-4 * scale, msg=f"gradient of {name}, step {step}"
            )
    for name, weight in trl.weights.items():
        moved = (weight - initial[name]).abs().max()
        assert moved > lr / 10, f"{name} did not move: the comparison would prove nothing"
        # AdamW's first step is lr * g / (|g| + 1e-8) per element, so rounding noise (~1e-8 absolute
        # here) in a gradient of that size moves its element by a good part of lr: compare the
        # elements whose gradient is clear of it at every step (the gradients were compared above).
        clear = torch.stack([recorded[name].abs() > 1e-6 for recorded in trl.gradients]).all(dim=0)
        assert clear.float().mean() > 0.5, name
        torch.testing.assert_close(
            ours.weights[name][clear], weight[clear], rtol=0, atol=steps * lr * 1e-3, msg=f"weight {name}"
        )


def check_parity(reference_dir: Path, out: Path, **setting: Any) -> dict[str, float]:
    """Train on the fixed rollouts with both, assert the same update; llmrl's metrics."""
    rollouts = fixed_rollouts()
    policy = perturbed_policy(reference_dir)
    initial = {n: p.detach().clone() for n, p in policy.named_parameters()}
    ours, metrics = llmrl_update(copy.deepcopy(policy), reference_dir, rollouts, **setting)
    trl = trl_update(policy, reference_dir, rollouts, out, **setting)
    assert (
        trl.advantages.abs().sum() > 0 and (trl.advantages[8:] == 0).all()
    )  # signal, and the flat group's 0
    assert_same_update(trl, ours, initial, setting["lr"], setting["num_iterations"])
    return metrics


# (beta, use_bias_correction_kl): TRL's default multiplies the KL by the ratio; both ways are checked.
KL_SETTINGS = [(0.0, True), (0.04, True), (0.04, False)]


@pytest.mark.parametrize(("beta", "use_bias_correction_kl"), KL_SETTINGS)
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_one_update_equals_trl(
    reference_dir, tmp_path, monkeypatch, loss_type, scale_rewards, beta, use_bias_correction_kl
):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental
    metrics = check_parity(
        reference_dir,
        tmp_path,
        loss_type=loss_type,
        scale_rewards=scale_rewards,
        beta=beta,
        use_bias_correction_kl=use_bias_correction_kl,
        num_iterations=1,
        epsilon_high=0.2,
        lr=1e-3,
    )
    assert metrics["ratio_mean"] == 1.0  # one step per generation: the ratio's denominator is the policy


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_two_steps_on_one_generation_equal_trl(reference_dir, tmp_path, monkeypatch, loss_type):
    """num_iterations=2: the second step's ratio is pi_new / pi_old, and at this learning rate the
    clip-higher range (0.2 / 0.28) clips some tokens."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    metrics = check_parity(
        reference_dir,
        tmp_path,
        loss_type=loss_type,
        scale_rewards="group",
        beta=0.04,
        use_bias_correction_kl=True,
        num_iterations=2,
        epsilon_high=0.28,
        lr=0.03,
    )
    assert metrics["clip_frac_low"] + metrics["clip_frac_high"] > 0
