"""GRPO side by side with Hugging Face TRL: the same model, task, prompts and settings, one command.

    python bench/compare_trl.py            # ~10 min on 2 CPU cores; results in runs/compare_trl/
    python bench/compare_trl.py [--steps 60] [--long-steps 10] [--repeats 3] [--betas 0 0.04]
        [--workloads natural long] [--lr 1e-4] [--eval-prompts 256] [--llmrl-set KEY=VALUE ...]
        [--out runs/compare_trl]
    python bench/compare_trl.py --learning-seeds 5 --steps 50 --clip-high 0.2 --second-model-seed 1
        # the learning study: held-out gain per seed of both, on two models

Needs TRL (the `dev` extra: ``bash scripts/setup.sh dev``). Uses the shipped tiny
default model (`tiny://arithmetic`, 0.9M-parameter Qwen2, ChatML) and writes the training prompts,
drawn from the arithmetic task's train split in the order llmrl's trainer draws them, to
``OUT/prompts.jsonl``; TRL reads that file in order (``shuffle_dataset=False``), and each llmrl run
checks that it trained on exactly those problems. Then, for every setting (workload x KL beta), it
trains each framework in a subprocess of its own (so that peak RSS is that framework's), repeats
interleaved and the order alternating, because timings drift over minutes on a shared machine:

- **TRL**: `GRPOTrainer` with its default generation (`model.generate`, no vLLM);
- **llmrl**: `llmrl.trainer.Trainer(load_config(None, overrides)).run()`, its defaults otherwise
  (``--llmrl-set`` adds overrides, e.g. ``training.pack_row_tokens=128``).

Matched settings: 8 prompts x 8 completions per step (TRL's ``per_device_train_batch_size`` counts
completions: 64), one optimizer step per RL step (no PPO epochs, so the ratio's denominator is the
policy being trained on both sides), the same max completion length, learning rate (constant,
no warm-up), AdamW betas and eps, gradient clipping at 1.0, clip range 0.2 / 0.28 (``--clip-high``),
beta with the k3 KL estimator, temperature 1 (no top-k/top-p), seed; group-normalised advantages;
per-token losses averaged over every completion token of the step (llmrl's `token_mean`, TRL's
``loss_type="dapo"``); float32 weights and math on both (TRL defaults to bf16 autocast), no gradient
checkpointing (TRL's default is on), no experiment tracker, no evaluation inside the timed steps.
Remaining differences: TRL's group std is the sample std (n - 1) and its epsilon 1e-4, llmrl's the
population std and 1e-6 by default, which scales advantages by at most 7% (AdamW mostly absorbs it;
``--llmrl-set algorithm.advantage_std_ddof=1 --llmrl-set algorithm.advantage_eps=1e-4`` gives
TRL's numbers exactly, tests/integration/test_trl_parity.py); with beta 0, llmrl skips the forward and
backward passes of rollouts whose advantage is 0 (whole groups
with equal rewards), which changes neither its loss nor its gradient.

Workloads:

- ``natural``: the arithmetic task as trained (completions stop at eos: 3-4 tokens, at most 16).
- ``long``: every completion exactly 64 tokens, for throughput. TRL bans eos for 64 tokens
  (``generation_kwargs={"min_new_tokens": 64}``); llmrl's engine runs with eos off
  (``LocalEngine(eos_token_ids=())``: an eos it samples does not stop the completion), through two
  plug-ins this script registers in the llmrl process (no llmrl option is needed): the inference
  type ``local-no-eos`` and the agent ``arithmetic-long``. Past the answer the completions run on in
  digits, so the task's reward (the first integer) would be 0 almost everywhere and llmrl would
  skip training; both sides score "the completion starts with the answer" instead (`reward`).

Printed per setting (one markdown table, also written to ``OUT/report.md``): median seconds per
step over steps 2..N (the first is warm-up) and its split into generation (including the reward)
and the rest (logprobs, loss, backward, optimizer, weight sync); completion tokens per second of
step time; peak RSS of the process; the model FLOP/s of the whole step as a fraction of a float32
matmul peak measured in the same run; and, for the natural workload, held-out sampled accuracy
(pass@1) and greedy accuracy before and after the N steps, both measured with llmrl's evaluation
(`llmrl.evaluation.evaluate_environments`, what `llmrl eval` runs) on each framework's saved model.
Figures are medians over repeats; ratios are llmrl / TRL within a repeat, median over repeats.
Each table ends with the targets it checks (llmrl >= 2x as fast per step on natural, >= 3x on long,
peak memory no higher, held-out accuracy at least as high), met or missed. Also saved:
``OUT/reward_curves.png`` (mean training reward per step of both frameworks, mean over repeats).
The share of the CPUs that other processes used during each run is measured (Linux /proc/stat)
and reported: timings taken beside other work are not comparable.

Step time: TRL's from `on_step_begin` to `on_step_end` (generation, loss, backward, optimizer);
llmrl's `time/step_s` (rollouts, update, weight sync). Generation: the time in TRL's `_generate`
and `_calculate_rewards`; llmrl's `time/rollouts_s`.

FLOPs are counted the same way for both, from the prompts and completions each produced: 2 x
weights per token plus causal attention, for generation (each group's prompt prefilled once, every
completion token but the last fed back), for forward + backward over every rollout (3 x forward,
logits on completion positions only) and for the reference model's forward when beta > 0. Padding,
recomputation and redundant prefills are not counted, and the work llmrl skips is counted as done,
so the figure measures the step, not the kernels.

Learning study (``--learning-seeds N``): instead of the speed tables, does either framework learn
more? The natural workload at beta 0 (``--steps``, ``--lr``, ``--clip-high``, ``--llmrl-set`` as
above) for seeds 0..N-1, on `tiny://arithmetic` and, with ``--second-model-seed S``, on a second
tiny model built from the same recipe with seed S (``OUT/models/seed-S``, built once, ~75 s). Each
seed has its own prompt order and sampling seed, used by both frameworks alike. Per seed and
framework: the held-out gain (after minus before, the same evaluation seed for both) in sampled
pass@1 and greedy accuracy, the mean training reward over the last 10 steps and the mean completion
length. Then per model: mean, sample std and min-max of each framework's gains, and the paired
difference llmrl - TRL over seeds with its standard error, the number of seeds llmrl wins, and the
exact two-sided p-value of a sign-flip permutation test (all 2^N sign assignments of the paired
differences; with N = 5 even five wins out of five give p = 0.0625). Also checked: both frameworks
trained on prompts of the same token counts (the chat template renders alike). Report:
``OUT/learning.md``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmrl.models.shape import ModelShape
    from llmrl.rewards.arithmetic import ArithmeticProblem

PROMPTS_PER_STEP = 8
GROUP_SIZE = 8
NATURAL_MAX_TOKENS = 16  # llmrl's default max_tokens for the task; the answers take 3-5 tokens
LONG_MAX_TOKENS = 64
FRAMEWORKS = ("trl", "llmrl")
NO_EOS_INFERENCE = "local-no-eos"  # the long workload's plug-ins (registered in the llmrl worker)
LONG_AGENT = "arithmetic-long"


@dataclass(frozen=True)
class Setting:
    """One table: a workload, its KL weight and the number of training steps."""

    workload: str
    beta: float
    steps: int

    @property
    def max_tokens(self) -> int:
        return LONG_MAX_TOKENS if self.workload == "long" else NATURAL_MAX_TOKENS

    @property
    def slug(self) -> str:
        return f"{self.workload}-beta{self.beta:g}"

    @property
    def title(self) -> str:
        completions = "stop at eos" if self.workload == "natural" else f"exactly {LONG_MAX_TOKENS} tokens"
        return f"{self.workload} ({completions}), beta {self.beta:g}, {self.steps} steps"


@dataclass
class WorkerSpec:
    """What one training subprocess runs; written as JSON next to its run folder."""

    framework: str
    setting: Setting
    model_dir: str
    prompts_file: str
    run_dir: str
    lr: float
    seed: int
    llmrl_overrides: list[str]
    clip_high: float = 0.28


# ---------------------------------------------------------------------------------------------
# Prompts


def write_prompts(path: Path, count: int, seed: int) -> list[dict[str, Any]]:
    """The first `count` training problems in the order llmrl's trainer draws them, as JSONL rows."""
    from llmrl.agents import build_agents
    from llmrl.agents.sampler import EpochSampler
    from llmrl.config import load_config

    config = load_config(None, [f"seed={seed}"])
    (agent,) = build_agents(config.environments, config.seed).agents
    problems = agent.train_problems
    order = EpochSampler(len(problems), seed=config.seed).take(count)  # what RewardOnlyAgent draws
    rows = [
        {
            "problem_id": problems[i].id,
            "prompt": [m.model_dump() for m in problems[i].prompt],
            "a": problems[i].answer.a,
            "op": problems[i].answer.op,
            "b": problems[i].answer.b,
        }
        for i in order
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def read_prompts(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# Workers (one subprocess per run)


def run_worker(spec: WorkerSpec) -> dict[str, Any]:
    """Train one framework on one setting; returns per-step records and the process's peak RSS."""
    import torch

    torch.manual_seed(spec.seed)
    started = time.perf_counter()
    result = run_trl(spec) if spec.framework == "trl" else run_llmrl(spec)
    result["wall_s"] = time.perf_counter() - started
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["threads"] = torch.get_num_threads()
    return result


def run_trl(spec: WorkerSpec) -> dict[str, Any]:
    """TRL's GRPOTrainer with every default that differs from llmrl's set explicitly."""
    # This script's folder comes first on sys.path, and its sibling bench/vllm.py would pass for the
    # vllm package, which TRL probes (and fails on) when imported.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from llmrl.rewards.arithmetic import ArithmeticProblem

    transformers.logging.set_verbosity_error()
    setting = spec.setting
    rows = read_prompts(spec.prompts_file)[: setting.steps * PROMPTS_PER_STEP]
    dataset = datasets.Dataset.from_list([{key: r[key] for key in ("prompt", "a", "op", "b")} for r in rows])
    steps: list[dict[str, Any]] = []

    def arithmetic_reward(
        completions: list[list[dict[str, str]]], a: list[int], op: list[str], b: list[int], **_: Any
    ) -> list[float]:
        problems = [ArithmeticProblem.of(*operands) for operands in zip(a, op, b, strict=True)]
        return [
            reward(setting.workload, c[-1]["content"], p) for c, p in zip(completions, problems, strict=True)
        ]

    class TimedGRPOTrainer(GRPOTrainer):
        """Records, per step, the time spent generating and scoring and what was generated."""

        def _generate(self, prompts: list) -> Any:
            began = time.perf_counter()
            output = super()._generate(prompts)
            prompt_ids, completion_ids = output[0], output[1]
            steps.append(
                {
                    "generate_s": time.perf_counter() - began,
                    "reward_s": 0.0,
                    "lengths": [[len(p), len(c)] for p, c in zip(prompt_ids, completion_ids, strict=True)],
                }
            )
            return output

        def _calculate_rewards(
            self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any
        ) -> Any:
            began = time.perf_counter()
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            steps[-1]["reward_s"] = time.perf_counter() - began
            steps[-1]["reward"] = float(rewards.sum(dim=1).mean())
            return rewards

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.began = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            steps[-1]["step_s"] = time.perf_counter() - self.began

    config = GRPOConfig(
        output_dir=spec.run_dir,
        seed=spec.seed,
        data_seed=spec.seed,
        max_steps=setting.steps,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE,  # counts completions
        gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE,
        num_iterations=1,
        shuffle_dataset=False,  # the prompts file's order, as llmrl draws them
        max_completion_length=setting.max_tokens,
        generation_kwargs={"min_new_tokens": LONG_MAX_TOKENS} if setting.workload == "long" else None,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=spec.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=setting.beta,
        epsilon=0.2,
        epsilon_high=spec.clip_high,
        use_bias_correction_kl=False,  # TRL's default weights the KL by the ratio; llmrl's does not
        loss_type="dapo",  # token mean over the whole step: llmrl's token_mean
        scale_rewards="group",
        mask_truncated_completions=False,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        model_init_kwargs={"dtype": "float32"},
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    trainer = TimedGRPOTrainer(
        model=spec.model_dir,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=dataset,
        callbacks=[StepTimer()],
    )
    train_began = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - train_began
    model_dir = Path(spec.run_dir) / "model"
    trainer.save_model(str(model_dir))
    return {"steps": steps, "train_s": train_s, "model_dir": str(model_dir), "version": _version("trl")}


def run_llmrl(spec: WorkerSpec) -> dict[str, Any]:
    """llmrl's trainer, configured from the built-in demo config with overrides."""
    from llmrl.config import load_config
    from llmrl.telemetry import read_jsonl, read_metrics
    from llmrl.trainer import Trainer

    setting = spec.setting
    overrides = [
        f"seed={spec.seed}",
        f"run_dir={spec.run_dir}",
        f"model.spec={spec.model_dir}",
        "model.dtype=float32",
        f"training.steps={setting.steps}",
        f"training.prompts_per_step={PROMPTS_PER_STEP}",
        f"training.group_size={GROUP_SIZE}",
        f"training.lr={spec.lr}",
        "training.lr_schedule=constant",
        "training.warmup_steps=0",
        "training.weight_decay=0.0",
        "training.max_grad_norm=1.0",
        "training.iterations=1",
        "training.mini_batches=1",
        f"algorithm.kl_beta={setting.beta}",
        "algorithm.kl_estimator=k3",
        "algorithm.clip_low=0.2",
        f"algorithm.clip_high={spec.clip_high}",
        "algorithm.aggregation=token_mean",
        "algorithm.advantage_estimator=grpo",
        "inference.generation.temperature=1.0",
        "inference.generation.top_p=1.0",
        "inference.generation.top_k=0",
        f"inference.generation.max_tokens={setting.max_tokens}",
        "evaluation.at_start=false",
        "evaluation.at_end=false",
        "evaluation.every=0",
        "checkpoint.every=0",
        "checkpoint.keep_last=1",
        "checkpoint.save_optimizer=false",
        "logging.tensorboard=false",  # TRL runs with report_to="none"
        f"logging.rollouts_per_step={PROMPTS_PER_STEP}",  # one per group: checks the prompts below
        "logging.progress=off",
    ]
    if setting.workload == "long":
        _register_long_plugins()
        overrides += [f"inference.type={NO_EOS_INFERENCE}", f"environments.0.agent_type={LONG_AGENT}"]
    trainer = Trainer(load_config(None, overrides + spec.llmrl_overrides))
    lengths: list[list[list[int]]] = []
    update = trainer.update

    def recording_update(batch: Any, generator: Any) -> Any:
        lengths.append([[len(r.trajectory[0]), r.num_generated] for r in batch.rollouts])
        return update(batch, generator)

    trainer.update = recording_update
    train_began = time.perf_counter()
    trainer.run()
    train_s = time.perf_counter() - train_began

    run_dir = Path(spec.run_dir)
    expected = [r["problem_id"] for r in read_prompts(spec.prompts_file)[: setting.steps * PROMPTS_PER_STEP]]
    trained = [r["problem_id"] for r in read_jsonl(run_dir / "rollouts.jsonl")]
    if trained != expected:
        raise RuntimeError(
            f"llmrl trained on other problems than {spec.prompts_file} lists: "
            f"{len(trained)} drawn, {sum(map(str.__ne__, trained, expected))} differ"
        )
    steps = []
    for record, step_lengths in zip(
        [m for m in read_metrics(run_dir / "metrics.jsonl") if m["step"] > 0], lengths, strict=True
    ):
        steps.append(
            {
                "step_s": record["time/step_s"],
                "generate_s": record["time/rollouts_s"],
                "reward_s": 0.0,
                "reward": record["reward/mean"],
                "lengths": step_lengths,
            }
        )
    model_dir = next((run_dir / "checkpoints").glob("step_*")) / "model"
    return {"steps": steps, "train_s": train_s, "model_dir": str(model_dir), "version": _version("llmrl")}


def _register_long_plugins() -> None:
    """Register the long workload's pieces: the embedded engine with eos off, so every completion runs
    to max_tokens, and the arithmetic task scored by `reward` ("the completion starts with the answer")."""
    from llmrl.envs.arithmetic import ArithmeticAgent
    from llmrl.inference.engine import LocalEngine
    from llmrl.registry import register_agent, register_inference

    class NoEosEngine(LocalEngine):
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs.setdefault("eos_token_ids", ())
            super().__init__(*args, **kwargs)

    class LongArithmeticAgent(ArithmeticAgent):
        def reward(self, response: Any, problem: Any) -> float:
            return reward("long", response.text, problem.answer)

    register_inference(NO_EOS_INFERENCE, NoEosEngine, replace=True)
    register_agent(LONG_AGENT, LongArithmeticAgent, replace=True)


def reward(workload: str, completion: str, problem: ArithmeticProblem) -> float:
    """The reward of both frameworks.

    Natural: the task's own (`llmrl.rewards.arithmetic.score`: the first integer is the answer). Long
    completions run on past the answer, usually in digits, so that first integer would almost never
    match and, with every reward 0, llmrl would skip the forward and backward passes that TRL runs;
    they score 1 when they start with the answer, which keeps both sides training.
    """
    from llmrl.rewards.arithmetic import score

    if workload == "long":
        return 1.0 if completion.lstrip().startswith(str(problem.answer)) else 0.0
    return score(completion, problem)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


# ---------------------------------------------------------------------------------------------
# FLOPs and the matmul peak


def model_shape(model_dir: str) -> ModelShape:
    import transformers

    from llmrl.models.shape import ModelShape

    return ModelShape.of(transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"))


def step_flops(shape: ModelShape, lengths: list[list[int]], beta: float) -> float:
    """Useful FLOPs of one GRPO step from its rollouts' (prompt, completion) lengths, groups contiguous."""
    body, head = shape.body, shape.lm_head
    flops = 0.0
    for index, (prompt, completion) in enumerate(lengths):
        if index % GROUP_SIZE == 0:  # generation: the group's prompt once, logits of its last token
            flops += 2 * body * prompt + 2 * head + shape.attention_flops(prompt)
        fed_back = completion - 1  # generation: every completion token but the last
        flops += 2 * (body + head) * fed_back + shape.attention_flops(fed_back, prompt + 1)
        forward = 2 * body * (prompt + completion) + 2 * head * completion
        forward += shape.attention_flops(prompt + completion)
        flops += forward * (3 + (1 if beta > 0 else 0))  # forward + backward, reference forward
    return flops


# ---------------------------------------------------------------------------------------------
# Evaluation


def evaluate(model_dir: str, seed: int, num_prompts: int) -> dict[str, float]:
    """Held-out arithmetic accuracy of a saved model, by llmrl's evaluation (what `llmrl eval` runs)."""
    from llmrl.agents import build_agents
    from llmrl.config import load_config
    from llmrl.evaluation import evaluate_environments
    from llmrl.inference import build_inference, run_sync
    from llmrl.seeding import derive_seed
    from llmrl.types import GenerationArgs

    config = load_config(
        None,
        [
            f"seed={seed}",
            f"model.spec={model_dir}",
            f"environments.0.agent_args.eval_size={num_prompts}",
            f"evaluation.num_prompts={num_prompts}",
            "evaluation.samples_per_prompt=8",
            "evaluation.ks=[1, 8]",
            f"inference.generation.max_tokens={NATURAL_MAX_TOKENS}",
            "inference.generation.temperature=1.0",
        ],
    )
    agents = build_agents(config.environments, config.seed)
    inference = build_inference(config.inference, config.model, seed=config.seed)
    # The trainer's evaluation seed: every model is scored on the same sampling streams.
    args = config.inference.generation.merge(GenerationArgs(seed=derive_seed(seed, "evaluation")))
    (summary,) = run_sync(evaluate_environments(agents, inference, config.evaluation, args)).values()
    return summary


# ---------------------------------------------------------------------------------------------
# The comparison


def launch(spec: WorkerSpec, log_path: Path) -> dict[str, Any]:
    """Run one worker subprocess; its output goes to `log_path`, its result comes back as JSON."""
    shutil.rmtree(spec.run_dir, ignore_errors=True)  # an earlier run there would be resumed, not redone
    Path(spec.run_dir).mkdir(parents=True)
    spec_path = Path(spec.run_dir) / "worker_spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    busy_before, ours_before, began = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter()
    with log_path.open("w") as log:
        done = subprocess.run(
            [sys.executable, __file__, "--worker", str(spec_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            check=False,
        )
    if done.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(
            f"{spec.framework} on {spec.setting.slug} failed ({done.returncode}); log {log_path}:\n{tail}"
        )
    result = json.loads((Path(spec.run_dir) / "result.json").read_text())
    if busy_before is not None:
        others = busy_cpu_seconds() - busy_before - (children_cpu_seconds() - ours_before)
        result["others_cpu_share"] = max(others, 0.0) / (
            (time.perf_counter() - began) * (os.cpu_count() or 1)
        )
    return result


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process of the machine has run since boot (Linux /proc/stat; None elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def worker_main(spec_path: str) -> None:
    data = json.loads(Path(spec_path).read_text())
    spec = WorkerSpec(**(data | {"setting": Setting(**data["setting"])}))
    result = run_worker(spec)
    (Path(spec.run_dir) / "result.json").write_text(json.dumps(result))


@dataclass
class Figures:
    """One run's summary figures (medians over steps 2..N)."""

    step_s: float
    generate_s: float
    rest_s: float
    tokens_per_step: float
    tokens_per_s: float
    flops_per_s: float
    peak_rss_mib: float


def figures(result: dict[str, Any], shape: ModelShape, beta: float) -> Figures:
    timed = result["steps"][1:] or result["steps"]  # the first step is warm-up
    step_s = statistics.median(s["step_s"] for s in timed)
    generate_s = statistics.median(s["generate_s"] + s["reward_s"] for s in timed)
    tokens = [sum(c for _, c in s["lengths"]) for s in timed]
    return Figures(
        step_s=step_s,
        generate_s=generate_s,
        rest_s=statistics.median(s["step_s"] - s["generate_s"] - s["reward_s"] for s in timed),
        tokens_per_step=statistics.median(tokens),
        tokens_per_s=statistics.median(t / s["step_s"] for t, s in zip(tokens, timed, strict=True)),
        flops_per_s=statistics.median(step_flops(shape, s["lengths"], beta) / s["step_s"] for s in timed),
        peak_rss_mib=result["peak_rss_mib"],
    )


def table(
    setting: Setting,
    runs: dict[str, list[Figures]],
    peak: float,
    accuracy: dict[str, list[dict[str, float]]] | None,
) -> list[str]:
    """The markdown table of one setting: medians over repeats, ratio llmrl / TRL within each repeat."""

    def median(framework: str, field: str) -> float:
        return statistics.median(getattr(f, field) for f in runs[framework])

    def ratio(field: str) -> float:
        return statistics.median(
            getattr(ll, field) / getattr(tr, field) for ll, tr in zip(runs["llmrl"], runs["trl"], strict=True)
        )

    rows = [
        ("seconds per step", "step_s", "{:.3f}"),
        ("- generation + reward", "generate_s", "{:.3f}"),
        ("- the rest: logprobs, loss, backward, optimizer, weight sync", "rest_s", "{:.3f}"),
        ("completion tokens per step", "tokens_per_step", "{:.0f}"),
        ("completion tokens / s", "tokens_per_s", "{:.0f}"),
        ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
        ("model GFLOP/s of the whole step", "flops_per_s", "{:.1f}"),
    ]
    lines = [f"### {setting.title}", "", "| | TRL | llmrl | llmrl / TRL |", "|---|---:|---:|---:|"]
    for label, field, fmt in rows:
        scale = 1e-9 if field == "flops_per_s" else 1.0
        lines.append(
            f"| {label} | {fmt.format(median('trl', field) * scale)} | "
            f"{fmt.format(median('llmrl', field) * scale)} | {ratio(field):.2f} |"
        )
    lines.append(
        f"| fraction of the fp32 matmul peak ({peak / 1e9:.0f} GFLOP/s) | "
        f"{median('trl', 'flops_per_s') / peak:.1%} | {median('llmrl', 'flops_per_s') / peak:.1%} | "
        f"{ratio('flops_per_s'):.2f} |"
    )
    if accuracy is not None:
        for metric, label in (
            ("pass@1", "held-out sampled accuracy (pass@1)"),
            ("greedy_accuracy", "greedy accuracy"),
        ):
            before = accuracy["before"][0][metric]
            after = {f: statistics.median(a[metric] for a in accuracy[f]) for f in FRAMEWORKS}
            lines.append(
                f"| {label}, {before:.3f} before, after {setting.steps} steps | {after['trl']:.3f} | "
                f"{after['llmrl']:.3f} | {after['llmrl'] / after['trl'] if after['trl'] else math.nan:.2f} |"
            )
    return lines


def verdict(
    setting: Setting, runs: dict[str, list[Figures]], accuracy: dict[str, list[dict[str, float]]] | None
) -> str:
    """The targets of this setting (llmrl's speed, memory and accuracy against TRL's), met or not."""
    speedup = statistics.median(
        tr.step_s / ll.step_s for ll, tr in zip(runs["llmrl"], runs["trl"], strict=True)
    )
    target = 2.0 if setting.workload == "natural" else 3.0
    memory = statistics.median(
        ll.peak_rss_mib / tr.peak_rss_mib for ll, tr in zip(runs["llmrl"], runs["trl"], strict=True)
    )
    parts = [
        f"llmrl is {speedup:.2f}x as fast per step (target {target:g}x: {'met' if speedup >= target else 'missed'})",
        f"peak RSS {memory:.2f}x TRL's (target <= 1: {'met' if memory <= 1 else 'missed'})",
    ]
    if accuracy is not None:
        after = {f: statistics.median(a["pass@1"] for a in accuracy[f]) for f in FRAMEWORKS}
        met = after["llmrl"] >= after["trl"]
        parts.append(
            f"held-out pass@1 {after['llmrl']:.3f} vs {after['trl']:.3f} (target >=: {'met' if met else 'missed'})"
        )
    return "Targets: " + "; ".join(parts) + f" ({len(runs['trl'])} interleaved repeats)."


def plot_rewards(curves: dict[str, dict[str, list[float]]], path: Path, window: int = 10) -> None:
    """Mean training reward per step (thin) and its `window`-step moving average, one panel per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
    for axis, (title, by_framework) in zip(axes[0], curves.items(), strict=True):
        for (framework, rewards), color in zip(by_framework.items(), ("tab:blue", "tab:orange"), strict=True):
            steps = range(1, len(rewards) + 1)
            average = [statistics.mean(rewards[max(0, i + 1 - window) : i + 1]) for i in range(len(rewards))]
            axis.plot(steps, rewards, color=color, alpha=0.3, linewidth=0.8)
            axis.plot(
                steps,
                average,
                color=color,
                label=f"{'TRL' if framework == 'trl' else 'llmrl'} ({window}-step mean)",
            )
        axis.set(title=title, xlabel="step", ylabel="mean training reward", ylim=(0, 1))
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------
# The learning study


def study_models(out: Path, second_seed: int | None) -> list[tuple[str, str]]:
    """(label, folder) of the models to study: the default tiny model and, optionally, one more built
    from its recipe with another seed (once; a folder that holds one is reused)."""
    import dataclasses

    from llmrl.models import tiny_model_path
    from llmrl.models.tiny import TinyRecipe
    from llmrl.models.tiny_build import build_tiny_model

    models = [("tiny://arithmetic", str(tiny_model_path("arithmetic")))]
    if second_seed is not None:
        folder = out / "models" / f"seed-{second_seed}"
        if not (folder / "config.json").exists():
            began = time.perf_counter()
            build_tiny_model(folder, dataclasses.replace(TinyRecipe(), seed=second_seed))
            print(f"built {folder} in {time.perf_counter() - began:.0f} s", flush=True)
        models.append((f"tiny recipe, seed {second_seed}", str(folder)))
    return models


@dataclass
class SeedOutcome:
    """One seed of the study: held-out accuracy before, and per framework after and on the way."""

    seed: int
    before: dict[str, float]
    after: dict[str, dict[str, float]]  # framework -> evaluation summary
    late_reward: dict[str, float]  # framework -> mean training reward over the last 10 steps
    completion_tokens: dict[str, float]  # framework -> mean completion length
    same_prompts: bool  # both trained on prompts of the same token counts, step by step

    def gain(self, framework: str, metric: str) -> float:
        return self.after[framework][metric] - self.before[metric]


def run_seed(model_dir: str, seed: int, args: argparse.Namespace, out: Path) -> SeedOutcome:
    """Train both frameworks from `model_dir` with `seed` (the order alternating by seed) and evaluate."""
    setting = Setting("natural", 0.0, args.steps)
    out.mkdir(parents=True, exist_ok=True)
    prompts_file = out / f"prompts-seed{seed}.jsonl"
    write_prompts(prompts_file, setting.steps * PROMPTS_PER_STEP, seed)
    results = {}
    for framework in FRAMEWORKS if seed % 2 == 0 else FRAMEWORKS[::-1]:
        name = f"{framework}-seed{seed}"
        spec = WorkerSpec(
            framework,
            setting,
            model_dir,
            str(prompts_file),
            str(out / name),
            args.lr,
            seed,
            args.llmrl_set,
            args.clip_high,
        )
        results[framework] = launch(spec, out / f"{name}.log")

    def prompt_lengths(framework: str) -> list[list[int]]:
        return [sorted(p for p, _ in step["lengths"]) for step in results[framework]["steps"]]

    return SeedOutcome(
        seed=seed,
        before=evaluate(model_dir, seed, args.eval_prompts),
        after={f: evaluate(results[f]["model_dir"], seed, args.eval_prompts) for f in FRAMEWORKS},
        late_reward={f: statistics.mean(s["reward"] for s in results[f]["steps"][-10:]) for f in FRAMEWORKS},
        completion_tokens={
            f: statistics.mean(c for s in results[f]["steps"] for _, c in s["lengths"]) for f in FRAMEWORKS
        },
        same_prompts=prompt_lengths("trl") == prompt_lengths("llmrl"),
    )


def sign_flip_p_value(differences: list[float]) -> float:
    """Exact two-sided p-value of a paired permutation test: the share of the 2^n sign assignments
    whose mean is at least as far from 0 as the observed one (no distribution assumed)."""
    observed = abs(statistics.mean(differences)) - 1e-12
    means = [
        abs(statistics.mean(sign * d for sign, d in zip(signs, differences, strict=True)))
        for signs in itertools.product((1, -1), repeat=len(differences))
    ]
    return sum(m >= observed for m in means) / len(means)


def spread(values: list[float]) -> str:
    """Mean +- sample std [min, max], in accuracy points."""
    deviation = statistics.stdev(values) if len(values) > 1 else 0.0
    return (
        f"{100 * statistics.mean(values):+.1f} +- {100 * deviation:.1f} "
        f"[{100 * min(values):+.1f}, {100 * max(values):+.1f}]"
    )


def paired(trl: list[float], llmrl: list[float]) -> str:
    """The paired difference llmrl - TRL: mean +- standard error, wins, sign-flip p-value."""
    differences = [ours - theirs for ours, theirs in zip(llmrl, trl, strict=True)]
    error = statistics.stdev(differences) / math.sqrt(len(differences)) if len(differences) > 1 else math.nan
    wins = sum(d > 0 for d in differences)
    return (
        f"{100 * statistics.mean(differences):+.1f} +- {100 * error:.1f} (SE); llmrl ahead in {wins}/"
        f"{len(differences)} seeds; sign-flip p = {sign_flip_p_value(differences):.3f}"
    )


def study_table(label: str, outcomes: list[SeedOutcome]) -> list[str]:
    """The markdown report of one model: a row per seed, then the spreads and paired differences."""
    lines = [
        f"### {label}",
        "",
        "| seed | pass@1 before | TRL gain | llmrl gain | greedy before | TRL gain | llmrl gain "
        "| last-10-step reward TRL / llmrl | completion tokens TRL / llmrl |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.seed} | {o.before['pass@1']:.3f} | {100 * o.gain('trl', 'pass@1'):+.1f} | "
            f"{100 * o.gain('llmrl', 'pass@1'):+.1f} | {o.before['greedy_accuracy']:.3f} | "
            f"{100 * o.gain('trl', 'greedy_accuracy'):+.1f} | {100 * o.gain('llmrl', 'greedy_accuracy'):+.1f} | "
            f"{o.late_reward['trl']:.3f} / {o.late_reward['llmrl']:.3f} | "
            f"{o.completion_tokens['trl']:.2f} / {o.completion_tokens['llmrl']:.2f} |"
        )
    lines.append("")
    for metric, name in (("pass@1", "sampled pass@1"), ("greedy_accuracy", "greedy accuracy")):
        gains = {f: [o.gain(f, metric) for o in outcomes] for f in FRAMEWORKS}
        lines += [
            f"- {name} gain, points (mean +- std [min, max]): TRL {spread(gains['trl'])}, "
            f"llmrl {spread(gains['llmrl'])}; llmrl - TRL {paired(gains['trl'], gains['llmrl'])}",
        ]
    same = sum(o.same_prompts for o in outcomes)
    lines += [
        f"- prompts of the same token counts in both frameworks, every step: {same}/{len(outcomes)} seeds",
        "",
    ]
    return lines


def learning_study(args: argparse.Namespace, out: Path, command: str) -> None:
    began = time.perf_counter()
    report = [
        f"`{command}`",
        "",
        f"TRL {_version('trl')}, llmrl {_version('llmrl')}; natural workload, beta 0, {args.steps} steps of "
        f"{PROMPTS_PER_STEP} prompts x {GROUP_SIZE} completions, lr {args.lr:g} constant, clip 0.2 / "
        f"{args.clip_high:g}, token-mean loss (TRL dapo); held-out {args.eval_prompts} problems x 8 samples "
        "(pass@1) and greedy; gains in accuracy points."
        + (f" llmrl overrides: {', '.join(args.llmrl_set)}." if args.llmrl_set else ""),
        "",
    ]
    for label, model_dir in study_models(out, args.second_model_seed):
        outcomes = []
        for seed in range(args.learning_seeds):
            outcome = run_seed(model_dir, seed, args, out / Path(model_dir).name)
            outcomes.append(outcome)
            print(
                f"{label} seed {seed}: pass@1 gain TRL {100 * outcome.gain('trl', 'pass@1'):+.1f}, llmrl "
                f"{100 * outcome.gain('llmrl', 'pass@1'):+.1f}; greedy TRL "
                f"{100 * outcome.gain('trl', 'greedy_accuracy'):+.1f}, llmrl "
                f"{100 * outcome.gain('llmrl', 'greedy_accuracy'):+.1f} ({time.perf_counter() - began:.0f} s)",
                flush=True,
            )
        report += study_table(label, outcomes)
        (out / "learning.json").write_text(json.dumps({label: [asdict(o) for o in outcomes]}, indent=1))
    report.append(f"Total time {time.perf_counter() - began:.0f} s.")
    text = "\n".join(report) + "\n"
    (out / "learning.md").write_text(text)
    print("\n" + text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps of the natural workload")
    parser.add_argument("--long-steps", type=int, default=10, help="training steps of the long workload")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every run")
    parser.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.04], help="KL weights to compare")
    parser.add_argument("--workloads", nargs="+", choices=("natural", "long"), default=["natural", "long"])
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate of both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-prompts", type=int, default=256, help="held-out problems of the accuracy figures"
    )
    parser.add_argument(
        "--llmrl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra llmrl config override (repeatable), e.g. training.pack_row_tokens=128",
    )
    parser.add_argument("--clip-high", type=float, default=0.28, help="upper clip range of both (lower: 0.2)")
    parser.add_argument(
        "--learning-seeds", type=int, default=0, help="run the learning study over this many seeds instead"
    )
    parser.add_argument(
        "--second-model-seed", type=int, help="learning study: also a tiny model built with this recipe seed"
    )
    parser.add_argument("--out", default="runs/compare_trl", help="folder for prompts, runs, report and plot")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one framework from a spec file
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return

    from llmrl.models import tiny_model_path

    began = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python bench/compare_trl.py", *(argv if argv is not None else sys.argv[1:])])
    if args.learning_seeds:
        learning_study(args, out, command)
        return
    model_dir = str(tiny_model_path("arithmetic"))
    settings = [
        Setting(w, b, args.steps if w == "natural" else args.long_steps)
        for w in args.workloads
        for b in args.betas
    ]
    prompts_file = out / "prompts.jsonl"
    write_prompts(prompts_file, max(s.steps for s in settings) * PROMPTS_PER_STEP, args.seed)
    shape = model_shape(model_dir)
    from generation import matmul_peak  # bench/generation.py, beside this script

    peak = matmul_peak()
    print(
        f"model {model_dir} ({shape.body + shape.lm_head:,} weights), prompts {prompts_file}, "
        f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s, {os.cpu_count()} CPUs",
        flush=True,
    )

    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):
        for index, setting in enumerate(settings):
            order = FRAMEWORKS if (repeat + index) % 2 == 0 else FRAMEWORKS[::-1]
            for framework in order:
                name = f"{setting.slug}-{framework}-r{repeat}"
                spec = WorkerSpec(
                    framework,
                    setting,
                    model_dir,
                    str(prompts_file),
                    str(out / name),
                    args.lr,
                    args.seed,
                    args.llmrl_set,
                    args.clip_high,
                )
                result = launch(spec, out / f"{name}.log")
                results.setdefault((setting.slug, framework), []).append(result)
                step = figures(result, shape, setting.beta)
                print(
                    f"repeat {repeat + 1}/{args.repeats} {setting.slug:<15} {framework:<5} "
                    f"{step.step_s:.3f} s/step (generation {step.generate_s:.3f}), {step.tokens_per_s:.0f} tok/s, "
                    f"peak RSS {step.peak_rss_mib:.0f} MiB, process {result['wall_s']:.0f} s, other processes "
                    f"{result.get('others_cpu_share', math.nan):.0%} of the CPUs",
                    flush=True,
                )
                gc.collect()
    peak = max(peak, matmul_peak())  # the machine's best over the run

    accuracy: dict[str, dict[str, list[dict[str, float]]]] = {}
    natural = [s for s in settings if s.workload == "natural"]
    if natural:
        evaluation_began = time.perf_counter()
        before = [evaluate(model_dir, args.seed, args.eval_prompts)]
        for setting in natural:
            accuracy[setting.slug] = {"before": before} | {
                f: [
                    evaluate(r["model_dir"], args.seed, args.eval_prompts) for r in results[(setting.slug, f)]
                ]
                for f in FRAMEWORKS
            }
        print(f"held-out evaluations: {time.perf_counter() - evaluation_began:.0f} s", flush=True)

    first = {f: results[(settings[0].slug, f)][0] for f in FRAMEWORKS}
    report = [
        f"`{command}`",
        "",
        f"TRL {first['trl']['version']}, llmrl {first['llmrl']['version']}, torch threads "
        f"{first['trl']['threads']} (TRL) / {first['llmrl']['threads']} (llmrl) on {os.cpu_count()} CPUs; lr "
        f"{args.lr:g}; {PROMPTS_PER_STEP} prompts x {GROUP_SIZE} completions per step; medians over steps 2..N "
        f"and {args.repeats} interleaved repeats; held-out accuracy on {args.eval_prompts} problems x 8 samples "
        f"(pass@1) and greedily, median over repeats."
        + (f" Extra llmrl overrides: {', '.join(args.llmrl_set)}." if args.llmrl_set else ""),
        "",
    ]
    for setting in settings:
        runs = {f: [figures(r, shape, setting.beta) for r in results[(setting.slug, f)]] for f in FRAMEWORKS}
        report += [
            *table(setting, runs, peak, accuracy.get(setting.slug)),
            "",
            verdict(setting, runs, accuracy.get(setting.slug)),
            "",
        ]
    curves = {
        f"natural, beta {s.beta:g}": {
            f: [
                statistics.mean(step)
                for step in zip(
                    *([x["reward"] for x in r["steps"]] for r in results[(s.slug, f)]), strict=True
                )
            ]
            for f in FRAMEWORKS
        }
        for s in natural
    }
    if curves:
        plot_rewards(curves, out / "reward_curves.png")
        report.append(f"Reward curves (mean over repeats): `{out / 'reward_curves.png'}`.")
    shares = [r["others_cpu_share"] for runs in results.values() for r in runs if "others_cpu_share" in r]
    if shares:
        report.append(
            f"Other processes used {statistics.median(shares):.0%} of the CPUs during the median run, "
            f"{max(shares):.0%} at most" + (" (timings disturbed)." if max(shares) > 0.1 else ".")
        )
    report.append(f"Total time {time.perf_counter() - began:.0f} s.")
    text = "\n".join(report) + "\n"
    (out / "report.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
