"""`RunConfig`: the whole run, one section per part, and the checks that span sections."""

from __future__ import annotations

from pydantic import Field, ValidationError, model_validator

from llmrl.config.algorithm import AlgorithmConfig, DistillationConfig
from llmrl.config.environments import EnvironmentConfig, EvaluationConfig
from llmrl.config.inference import VLLM_LORA_RANKS, InferenceConfig
from llmrl.config.model import ModelConfig
from llmrl.config.outputs import CheckpointConfig, LoggingConfig
from llmrl.config.sections import Section
from llmrl.config.training import TrainingConfig


class RunConfig(Section):
    seed: int = 0
    """Seed of every random choice in the run (sampling, problem order, initialisation)."""
    run_dir: str = "runs/demo"
    """Folder for metrics, logs, plots and checkpoints; a relative one is relative to the working directory
    (not to the config file's folder)."""
    plugins: list[str] = Field(default_factory=list)
    """Python modules (or `.py` files, imported under their file name) imported before building agents, so
    they can register their own types and provide reward functions (`module:function`). A module name is
    looked for beside the config file (as `NAME.py`, or a package folder `NAME/`, for a name without dots),
    then on the import path, then in the working directory. Only honoured for configs read from a local
    file, never for one received over the network."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """How rollouts are generated."""
    environments: list[EnvironmentConfig] = Field(min_length=1)
    """Environments to train and evaluate on."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimator and loss."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """Optimisation schedule."""
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    """Held-out evaluation."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics, logs and traces."""
    distillation: DistillationConfig | None = None
    """On-policy distillation from a teacher model (`DistillationConfig`); None (absent): off."""

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if not any(env.weight > 0 and not env.evaluation_only for env in self.environments):
            raise ValueError(
                "environments: at least one environment needs weight > 0 and evaluation_only false"
            )
        names = [env.name for env in self.environments]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"environments: env ids must be unique, repeated: {duplicates} (set env_id)")
        training = self.training
        if training.group_size < 2:
            raise ValueError(
                "training.group_size: 1 leaves every rollout alone in its group, so its baseline is its own "
                "reward and every advantage is 0 (nothing is learned); use 2 or more"
            )
        if training.master_dtype not in ("float32", self.model.dtype):
            raise ValueError(
                f"training.master_dtype: {training.master_dtype!r} must be float32 or model.dtype "
                f"({self.model.dtype!r}): weights are kept at least as precise as the compute"
            )
        if self.model.dtype == "float16" and training.master_dtype == "float32":
            raise ValueError(
                "model.dtype: float16 compute over float32 master weights needs loss scaling, which llmrl does "
                "not do (float16 gradients underflow without it); use bfloat16, or training.master_dtype: float16"
            )
        if self.model.attn_implementation == "varlen" and training.share_prefixes:
            raise ValueError(
                "model.attn_implementation: varlen attends whole sequences and cannot keep a shared prompt's "
                "samples apart; set training.share_prefixes: false"
            )
        self._check_colocation()
        self._check_partial_rollouts()
        # vLLM is asked when it starts (`llmrl.inference.vllm.routed_experts`): whether it returns routes
        # depends on its version and build, and a managed server's vLLM is another Python than this one.
        if training.router_replay and self.inference.type not in ("local", "vllm"):
            raise ValueError(
                f"training.router_replay: inference.type {self.inference.type!r} does not return the experts it "
                "routed each token through; the embedded engine (inference.type: local) does"
            )
        if (
            self.model.lora is not None
            and self.inference.type == "vllm"
            and self.inference.vllm.mode == "servers"
        ):
            if self.model.lora.rank > VLLM_LORA_RANKS[-1]:
                raise ValueError(
                    f"model.lora.rank: {self.model.lora.rank} is more than vLLM serves ({VLLM_LORA_RANKS[-1]})"
                )
        if training.mini_batches > training.prompts_per_step * training.group_size:
            raise ValueError(
                f"training.mini_batches: {training.mini_batches} is more than the "
                f"{training.prompts_per_step * training.group_size} rollouts of a step"
            )
        if training.micro_batch_tokens <= self.inference.generation.max_tokens:
            raise ValueError(
                f"training.micro_batch_tokens: {training.micro_batch_tokens} tokens cannot hold one rollout of "
                f"inference.generation.max_tokens={self.inference.generation.max_tokens} completion tokens "
                "plus its prompt; raise it"
            )
        for index, env in enumerate(self.environments):
            self._check_trainable_sampling(index, env)
        too_big = [k for k in self.evaluation.ks if k > self.evaluation.samples_per_prompt or k < 1]
        if too_big:
            raise ValueError(
                f"evaluation.ks: every k must be in 1..samples_per_prompt "
                f"({self.evaluation.samples_per_prompt}), got {too_big}"
            )
        return self

    def _check_partial_rollouts(self) -> None:
        training = self.training
        if training.max_staleness is not None and not training.partial_rollouts:
            raise ValueError(
                "training.max_staleness: only partial rollouts carry groups over to later steps; without them "
                "a token is at most training.generation_lag versions old"
            )
        if not training.partial_rollouts:
            return
        if training.generation_lag < 1:
            raise ValueError(
                "training.partial_rollouts: needs training.generation_lag >= 1 (with no lag every batch is "
                "generated whole before its step)"
            )
        if training.max_staleness is not None and training.max_staleness < training.generation_lag:
            raise ValueError(
                f"training.max_staleness: {training.max_staleness} is below training.generation_lag "
                f"({training.generation_lag}), which makes every token that old by design"
            )
        if self.algorithm.dynamic_sampling:
            raise ValueError(
                "algorithm.dynamic_sampling: not with training.partial_rollouts (groups are drawn one at a "
                "time; a group without signal still trains)"
            )

    def _check_colocation(self) -> None:
        vllm = self.inference.vllm
        if vllm.mode != "colocate" or self.inference.type != "vllm":
            if vllm.sleep_level:
                raise ValueError(
                    "inference.vllm.sleep_level: only a colocated engine sleeps (vllm.mode: colocate)"
                )
            return
        if self.inference.base_url:
            raise ValueError(
                "inference.base_url: a colocated engine runs in the trainer's process; unset it, or use "
                "inference.vllm.mode: servers to train from the servers at it"
            )
        if vllm.sleep_level and self.training.generation_lag:
            raise ValueError(
                f"inference.vllm.sleep_level: an engine asleep during updates cannot generate ahead "
                f"(training.generation_lag: {self.training.generation_lag}); set one of them to 0"
            )

    def inference_for_run(self) -> InferenceConfig:
        """The inference section as this run builds it, with what depends on other sections resolved:
        a LoRA run's vLLM adapter slots (`VLLMConfig.resolved_max_loras`) follow the generation lag, and
        router replay has the engine record routes."""
        inference = self.inference
        if self.training.router_replay:
            inference = inference.model_copy(update={"record_routes": True})
        if self.model.lora is None or inference.type != "vllm":
            return inference
        slots = inference.vllm.resolved_max_loras(self.training.generation_lag)
        return inference.model_copy(update={"vllm": inference.vllm.model_copy(update={"max_loras": slots})})

    def _check_trainable_sampling(self, index: int, env: EnvironmentConfig) -> None:
        """A trained environment's sampling options must be ones the trainer's logprobs can follow."""
        own = env.agent_args.get("generation_args")
        if env.evaluation_only or env.weight == 0 or not isinstance(own, dict | None):
            return
        try:
            args = self.inference.generation.merge(own)
        except ValidationError:
            return  # the agent reports its own bad generation_args, naming the field
        where = f"environments[{index}] ({env.name})"
        if args.temperature == 0:
            raise ValueError(f"{where}: temperature 0 (greedy) leaves no distribution to train on")
        if args.untrainable_options:
            raise ValueError(
                f"{where}: {args.untrainable_options} change the sampled distribution in ways the trainer "
                "cannot reproduce in its logprobs; use them only with evaluation_only: true"
            )
