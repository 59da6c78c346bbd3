"""A GRPO loop on the tiny model's 2-digit addition, written against the official `tinker` SDK only, the
way a Tinker user writes one: sample a group per problem from the current sampling client, reward and
centre it, train on it with ``importance_sampling``, take a new sampling client.

`tests/integration/test_tinker_rl_loop.py` asserts that it learns; `bench/tinker_overhead.py` times it
and sets its held-out curve beside ``llmrl train``'s. A plain module (not a test file): both import it.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tinker
from tinker import types

from llmrl.agents.base import Problem
from llmrl.envs.arithmetic import ArithmeticAgent
from llmrl.rewards.arithmetic import score

BASE = "tiny://arithmetic"
MAX_TOKENS = 16
"""Completion budget, ``llmrl train``'s default (the tiny model answers in 3 or 4 tokens)."""
EVAL_SEED = 10**6
"""Sampling seed of every held-out evaluation: a curve then compares adapters, not sampling noise."""


@dataclass(frozen=True)
class LoopSettings:
    """One GRPO run. The defaults are a Tinker user's: advantages only centred, the loss Tinker's sum
    over tokens, no gradient clipping; `matching_llmrl` gives ``llmrl train``'s update instead."""

    steps: int = 20
    problems_per_step: int = 16
    group_size: int = 8
    learning_rate: float = 1e-3
    rank: int = 16
    seed: int = 0
    lr_schedule: str = "constant"
    """``constant`` or ``cosine`` (llmrl's: from `learning_rate` at step 1 down to 0 after the last)."""
    train_unembed: bool = False
    """The SDK's default is True; llmrl's ``all-linear`` LoRA (examples/arithmetic_lora.yaml) leaves the
    output head out, and so does this loop, so that both train the same adapters."""
    beta2: float = 0.999
    """llmrl's AdamW betas are torch's (0.9, 0.999); Tinker's default beta2 is 0.95."""
    eps: float = 1e-8
    """torch's AdamW eps, which llmrl keeps; Tinker's default is 1e-12."""
    std_normalized: bool = False
    """Divide each group's centred rewards by their spread (llmrl's default ``grpo`` estimator)."""
    token_mean: bool = False
    """Divide the advantages by the step's completion tokens: Tinker's losses are sums over tokens, so
    this makes the step's loss llmrl's default ``token_mean`` (and its gradient norm llmrl's)."""
    grad_clip_norm: float = 0.0
    """Clip the gradient's global norm (0: off, Tinker's default; llmrl clips at 1.0)."""
    eval_every: int = 10
    """Evaluate on the held-out problems every this many steps (and before the first, after the last)."""
    eval_problems: int = 64
    eval_samples: int = 8
    """Completions per held-out problem at temperature 1 (llmrl's evaluation: 64 x 8)."""

    def matching_llmrl(self) -> LoopSettings:
        """These settings with ``llmrl train``'s update: GRPO's std-normalised advantages, the
        token-mean loss and the gradient clipped at 1.0."""
        return dataclasses.replace(self, std_normalized=True, token_mean=True, grad_clip_norm=1.0)


@dataclass
class LoopRecord:
    """What a run measured: held-out pass@1 by step (0: before training) and each step's figures."""

    held_out: dict[int, float] = field(default_factory=dict)
    train_rewards: list[float] = field(default_factory=list)
    """Mean reward of each step's samples."""
    sample_s: list[float] = field(default_factory=list)
    """Seconds to sample each step's groups."""
    update_s: list[float] = field(default_factory=list)
    """Seconds from sending ``forward_backward`` to the result of the ``optim_step`` sent after it."""
    update_sequences: list[int] = field(default_factory=list)
    update_tokens: list[int] = field(default_factory=list)
    """Completion tokens (those with an advantage) each update trained on: what llmrl's
    ``train/num_tokens`` counts."""
    snapshot_s: list[float] = field(default_factory=list)
    """Seconds of each ``save_weights_and_get_sampling_client`` after an update."""
    logprob_mismatch: list[float] = field(default_factory=list)
    """Largest gap, in each update, between a completion token's logprob under the trained model and the
    sampler's: the data are on-policy, so a sampler serving other weights than the trained ones shows."""


def prompt_tokens(tokenizer: Any, problem: Problem) -> list[int]:
    """The problem's prompt as the demo renders it: the agent's chat messages through the chat template
    with the assistant turn opened (what the tiny model was warmed up to answer)."""
    messages = [m.model_dump() for m in problem.prompt]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def completion_reward(tokenizer: Any, tokens: Sequence[int], problem: Problem) -> float:
    """llmrl's arithmetic reward of a sampled completion (1.0: its first integer is the answer)."""
    return score(tokenizer.decode(list(tokens), skip_special_tokens=True), problem.answer)


def sample_groups(
    sampler: tinker.SamplingClient,
    tokenizer: Any,
    problems: Sequence[Problem],
    group_size: int,
    seed: int,
) -> list[list[types.SampledSequence]]:
    """`group_size` completions of each problem at temperature 1. Every request is sent before any
    result is awaited, so that the server decodes them together."""
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(prompt_tokens(tokenizer, problem)),
            group_size,
            types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed * 100_003 + index),
        )
        for index, problem in enumerate(problems)
    ]
    return [future.result(timeout=300).sequences for future in futures]


def held_out_pass_at_1(
    sampler: tinker.SamplingClient, tokenizer: Any, problems: Sequence[Problem], samples: int
) -> float:
    """Mean reward of `samples` completions of each held-out problem (pass@1 estimated from n samples,
    as llmrl's evaluation reports it)."""
    groups = sample_groups(sampler, tokenizer, problems, samples, seed=EVAL_SEED)
    rewards = [
        completion_reward(tokenizer, sequence.tokens, problem)
        for problem, group in zip(problems, groups, strict=True)
        for sequence in group
    ]
    return statistics.fmean(rewards)


@dataclass(frozen=True)
class Scored:
    """One sampled completion with its prompt and advantage."""

    prompt: list[int]
    sequence: types.SampledSequence
    advantage: float


def scored_group(
    tokenizer: Any, problem: Problem, group: Sequence[types.SampledSequence], std_normalized: bool
) -> tuple[list[Scored], list[float]]:
    """The group's completions with their advantages (rewards minus the group's mean, divided by their
    population spread when `std_normalized`), and its rewards. A group whose rewards are all equal
    teaches nothing: none of its completions is kept."""
    rewards = [completion_reward(tokenizer, sequence.tokens, problem) for sequence in group]
    mean = statistics.fmean(rewards)
    if all(reward == mean for reward in rewards):
        return [], rewards
    spread = statistics.pstdev(rewards) if std_normalized else 1.0
    prompt = prompt_tokens(tokenizer, problem)
    return [
        Scored(prompt, sequence, (reward - mean) / spread)
        for sequence, reward in zip(group, rewards, strict=True)
    ], rewards


def importance_sampling_datum(scored: Scored, advantage_scale: float = 1.0) -> types.Datum:
    """The ``importance_sampling`` datum of a completion: the model reads prompt + completion but its last
    token and predicts each next token; the completion's positions carry the sampler's logprobs and the
    advantage, the prompt's carry 0 for both (an advantage of 0 leaves them out of the loss)."""
    completion = list(scored.sequence.tokens)
    assert scored.sequence.logprobs is not None and len(scored.sequence.logprobs) == len(completion)
    tokens = scored.prompt + completion
    prompt_positions = len(scored.prompt) - 1  # position i predicts tokens[i + 1]
    advantage = scored.advantage * advantage_scale
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * prompt_positions + list(scored.sequence.logprobs),
            "advantages": [0.0] * prompt_positions + [advantage] * len(completion),
        },
    )


def learning_rate(settings: LoopSettings, step: int) -> float:
    """The rate of `step` (1-based) under `settings.lr_schedule`, as ``llmrl train`` schedules it (torch's
    CosineAnnealingLR over the run's steps)."""
    if settings.lr_schedule == "constant":
        return settings.learning_rate
    assert settings.lr_schedule == "cosine", settings.lr_schedule
    return settings.learning_rate * (1 + math.cos(math.pi * (step - 1) / settings.steps)) / 2


def grpo_loop(
    service: tinker.ServiceClient,
    tokenizer: Any,
    settings: LoopSettings,
    on_evaluation: Callable[[int, float], None] | None = None,
) -> LoopRecord:
    """`settings.steps` GRPO steps of a new LoRA adapter on the `train` split's problems. The held-out
    evaluations use the `test` split, which no training step draws from: a problem's split is a
    property of the problem (`llmrl.rewards.arithmetic`)."""
    agent = ArithmeticAgent(eval_size=settings.eval_problems)
    train_problems, held_out = agent.prompts(), agent.eval_prompts()
    order = random.Random(settings.seed)
    training = service.create_lora_training_client(
        base_model=BASE, rank=settings.rank, seed=settings.seed, train_unembed=settings.train_unembed
    ).result(timeout=120)
    record = LoopRecord()

    def evaluate(step: int, sampler: tinker.SamplingClient) -> None:
        pass_at_1 = held_out_pass_at_1(sampler, tokenizer, held_out, settings.eval_samples)
        record.held_out[step] = pass_at_1
        if on_evaluation is not None:
            on_evaluation(step, pass_at_1)

    sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
    evaluate(0, sampler)
    for step in range(1, settings.steps + 1):
        problems = order.sample(train_problems, settings.problems_per_step)
        started = time.perf_counter()
        groups = sample_groups(
            sampler, tokenizer, problems, settings.group_size, seed=settings.seed * 10_000 + step
        )
        record.sample_s.append(time.perf_counter() - started)
        kept, rewards = [], []
        for problem, group in zip(problems, groups, strict=True):
            group_kept, group_rewards = scored_group(tokenizer, problem, group, settings.std_normalized)
            kept += group_kept
            rewards += group_rewards
        record.train_rewards.append(statistics.fmean(rewards))
        if kept:
            completion_tokens = sum(len(scored.sequence.tokens) for scored in kept)
            scale = 1.0 / completion_tokens if settings.token_mean else 1.0
            data = [importance_sampling_datum(scored, scale) for scored in kept]
            adam = types.AdamParams(
                learning_rate=learning_rate(settings, step),
                beta2=settings.beta2,
                eps=settings.eps,
                grad_clip_norm=settings.grad_clip_norm,
            )
            started = time.perf_counter()
            # Both calls are sent before either result is awaited, as the Tinker docs advise: the
            # optimizer step queues behind the backward pass instead of waiting a round trip.
            backward = training.forward_backward(data, "importance_sampling")
            optimized = training.optim_step(adam)
            trained = backward.result(timeout=300)
            optimized.result(timeout=300)
            record.update_s.append(time.perf_counter() - started)
            record.logprob_mismatch.append(
                max(
                    abs(trained_logprob - sampled_logprob)
                    for scored, output in zip(kept, trained.loss_fn_outputs, strict=True)
                    for trained_logprob, sampled_logprob in zip(
                        output["logprobs"].data[-len(scored.sequence.tokens) :],
                        scored.sequence.logprobs,
                        strict=True,
                    )
                )
            )
            record.update_sequences.append(len(data))
            record.update_tokens.append(completion_tokens)
        started = time.perf_counter()
        sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
        record.snapshot_s.append(time.perf_counter() - started)
        if step % settings.eval_every == 0 or step == settings.steps:
            evaluate(step, sampler)
    return record
