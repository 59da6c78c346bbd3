"""The optimisation schedule (`TrainingConfig`): steps, batch sizes, learning rate, generation lag, and
how the policy is held and run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from llmrl.config.sections import Section


class TrainingConfig(Section):
    steps: int = Field(40, ge=0)
    """Number of RL steps (rollout collection + policy update)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompt groups per step."""
    group_size: int = Field(8, ge=1)
    """Completions sampled per prompt (the GRPO group)."""
    lr: float = Field(2e-5, gt=0.0)
    """Peak learning rate of AdamW."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this; None disables clipping."""
    iterations: int = Field(1, ge=1)
    """Optimisation passes over each step's rollouts (PPO epochs)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass: the rollouts are split into this many mini-batches."""
    micro_batch_tokens: int = Field(4096, ge=1)
    """Token budget of one forward/backward micro-batch (rows x row width, padding included); bounds
    activation memory."""
    pack_row_tokens: int = Field(512, ge=1)
    """Longest packed row (rollouts laid end to end); a rollout longer than this gets a row of its own.
    Each step picks the row length up to this (and whether to share prompts) by estimated FLOPs:
    attention over a row costs its length squared with the sdpa/eager kernels."""
    share_prefixes: bool = True
    """Allow a prompt to be encoded once for several of its rollouts (an attention mask keeps the
    samples apart): same loss and gradients, fewer tokens; used when it makes a step cheaper, never
    for models with sliding-window attention layers."""
    generation_lag: int = Field(0, ge=0)
    """Steps generation runs ahead of training: batch t is generated with the weights of step t-1-lag while
    earlier steps train (0 = on-policy, no overlap)."""
    partial_rollouts: bool = False
    """With a lag: generate continuously, one group at a time, keeping up to (lag + 1) x prompts_per_step groups
    generating or waiting; each step trains on the first `prompts_per_step` groups to complete, and a group
    that misses a batch goes into a later one (never dropped for being slow). Batches then depend on timing:
    runs are not bitwise repeatable (docs/training.md)."""
    max_staleness: int | None = Field(None, ge=1)
    """With partial rollouts: most weight versions a group's oldest token may be behind the policy it trains;
    a complete group older than that is generated again for the same problem (`rollout/stale_regenerated`).
    At least `generation_lag`. None: no bound."""
    max_inference_failure_frac: float | None = Field(None, ge=0.0, lt=1.0)
    """Largest fraction of a batch's rollouts that may fail in inference (server unreachable, refused, timed
    out); a batch over it is neither banked nor trained on, and the run stops (exit status 75) so that a
    rerun regenerates it. Rollouts whose agent's environment server did not answer (`unreachable` failures
    of `agent_type: openenv`) are counted apart against the same fraction, and stop the run the same way.
    None: stop when any whole group failed in inference, or could not reach its environment server."""
    max_user_failure_frac: float | None = Field(0.5, ge=0.0, lt=1.0)
    """Largest fraction of rollouts that may fail in user code (a reward function or `reward`/`observe`
    that raises or returns no finite number, an agent program that raises or makes no model call), averaged
    over the last 3 steps; over it, the run stops with exit status 1 and one line naming the most frequent
    failure, before that step trains. A step whose rollouts all failed in user code always stops the run.
    None: only such a step does."""
    overlong_prompts: Literal["skip", "refuse"] = "skip"
    """Problems whose prompt leaves no room for `inference.generation.max_tokens` in the model's context,
    found as the data loads: `skip` trains without them (one line names them and their count), `refuse`
    stops before training, naming them. A later turn that does not fit, or a server with a shorter context,
    fails its rollouts as a data failure (`failures/data`): they are left out of the batch, and the run goes
    on (an agent program's call is refused to the program, as an HTTP 400 it may handle)."""
    router_replay: bool | Literal["observe"] = False
    """Mixture-of-experts models: `true` runs the trainer's forwards through the experts the embedded
    engine chose for each token (Rollout Routing Replay, docs/models.md), the gating weights still from
    the live router; `observe` records the engine's choices and only logs how often the trainer's
    routers part from them (`train/routing/differs_*`); `false` neither. Refused for a model without MoE
    layers and for inference that cannot record routes."""
    deterministic: bool = True
    """Use deterministic kernels so that the same config gives the same numbers."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the policy trains; `auto` picks CUDA when available."""
    master_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the policy's weights, gradients and optimizer state (the master weights). float32 keeps small
    updates that a bfloat16 weight would round away (at lr 1e-6 most of them); setting it to `model.dtype`
    halves that memory at this cost. Either float32 or the same as `model.dtype`."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations during the backward pass instead of keeping them: same loss
    and gradients, less memory, for about one more forward pass of time (docs/training.md)."""
    tf32: bool = True
    """Let CUDA float32 matmuls and convolutions use TF32 tensor cores (about 10 mantissa bits in the
    products); no effect on CPU."""
