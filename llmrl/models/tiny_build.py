"""The build of the embedded default model, `tiny://arithmetic`, and the command that rebuilds it.

No model hub is reachable where llmrl is developed and tested, so the built-in tasks get a model
made from nothing, seeded and deterministic, on one CPU core:

1. Tokenizer: byte-level BPE (any text encodes; digits are split one per token so numbers are
   spelled digit by digit) trained with the `tokenizers` library on a generated corpus of
   arithmetic chats plus templated English word problems, countdown prompts and a little code,
   wrapped as a transformers fast tokenizer with a ChatML template
   (``<|im_start|>role\\n...<|im_end|>\\n``; eos = ``<|im_end|>``, pad = ``<|endoftext|>``).
2. Model: `Qwen2ForCausalLM` (hidden 128, 4 layers, tied embeddings, 1024 positions), float32.
3. Warm-up: supervised next-token loss on the answers of chat-formatted 2-digit additions from
   the *train* split of `llmrl.rewards.arithmetic`, until the expected sampled accuracy (temperature
   1) on held-back validation problems reaches 30%: the model has learnt the format and part of
   the task, far from all of it, so GRPO has signal. See `train_warmup` for why it stops on a
   measurement rather than after a fixed number of steps.

The recipe, and the shipped build that `tiny://arithmetic` loads, are in `llmrl.models.tiny`.
Rebuilding is for whoever changes the recipe:

    python -m llmrl.models.tiny_build                       # check the shipped build, print its accuracy
    python -m llmrl.models.tiny_build --rebuild             # build anew, say how it differs from the shipped one
    python -m llmrl.models.tiny_build --rebuild --replace   # ... and ship the new build
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import tokenizers
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from llmrl.files import move_into_place
from llmrl.models.tiny import (
    BUILD_INFO,
    CHECKSUMS,
    RECIPE_VERSION,
    TINY_MODELS,
    TinyRecipe,
    read_checksums,
    recipe_for,
    shipped_folder,
    tiny_model_path,
    write_checksums,
)
from llmrl.rewards.arithmetic import ArithmeticProblem, iter_problems, prompt_messages, sample_problems, score

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ---------------------------------------------------------------------------------------------
# Tokenizer


_NAMES = (
    "Natalia",
    "Weng",
    "Betty",
    "Julie",
    "James",
    "Albert",
    "Ken",
    "Alexis",
    "Tina",
    "Randy",
    "Maria",
    "Omar",
)
_ITEMS = ("apples", "books", "clips", "marbles", "cookies", "pencils", "eggs", "shirts", "tickets", "flowers")
_QUESTIONS = (
    "{name} earns ${n} an hour for babysitting. Yesterday she babysat for {m} hours. How much did she earn?",
    "A store sells {item} for ${n} each. If {name} buys {m} of them and pays with a ${k} bill, how much change "
    "does {name} get back?",
    "{name} reads {n} pages of a book every day. The book has {m} pages. How many days will it take to finish it?",
    "There are {n} students in a class and {m} percent of them are girls. How many boys are in the class?",
    "{name} is {n} years old and {friend} is {m} years older. What will their combined age be in {k} years?",
    "A farmer collects {n} eggs each morning and sells them in cartons of a dozen. How many full cartons can he "
    "fill in {m} days?",
    "{name} runs {n} kilometers on Monday, twice as far on Tuesday and {k} kilometers less on Wednesday. What is "
    "the total distance for the week so far?",
    "The recipe needs {n} cups of flour for every {m} cookies. How much flour does {friend} need to bake {k} "
    "dozen cookies?",
)
_PROSE = """\
Question: Read the problem carefully and solve it step by step. Show your reasoning, then give the final answer.
Let's think step by step. First, we find the total number of items. Then we subtract the ones that were sold.
The answer is the number of items that are left. Therefore, the final answer is \\boxed{12}.
We know that the sum of two numbers is their total, and the product of two numbers is the result of multiplying them.
If each box holds six eggs and there are four boxes, there are 6 * 4 = 24 eggs in all.
The difference between the price before and after the discount is how much money she saved.
A train travels at a constant speed of 60 miles per hour. How far does it travel in three hours?
Solve for x: 3x + 5 = 20. Subtract 5 from both sides to get 3x = 15, then divide by 3 so x = 5.
The area of a rectangle equals its length times its width; the perimeter is twice the sum of both sides.
Half of the students in the class walk to school, a quarter ride a bike and the rest take the bus.
Write a function that returns the largest value in a list of integers, and test it on a few examples.
The probability of an event is a number between zero and one. What is the average of these values?
There were some people at the party when it started, and more of them arrived every hour until midnight.
Simplify the fraction, convert the result to a decimal, and round it to the nearest hundredth.
The shop was open from Monday to Friday, so the weekly profit is the daily profit multiplied by five.
Each week the tank loses a third of its water; after two weeks, what remains is four ninths of the original.
An integer is even when it is divisible by two, and a prime number has exactly two positive divisors.
The triangle has a base of eight centimeters and a height of five, so its area is twenty square centimeters.
The input is a string; the function should count the vowels and return the count as an integer.
"""
_CODE = """\
def largest(values: list[int]) -> int:
    \"\"\"Return the largest value.\"\"\"
    best = values[0]
    for value in values[1:]:
        if value > best:
            best = value
    return best


print(largest([3, 1, 4, 1, 5]))
"""


def _tokenizer_corpus(seed: int) -> Iterator[str]:
    """Texts that teach the BPE merges: mostly arithmetic chats, plus enough English for other tasks."""
    rng = random.Random(seed)
    for _ in range(5_000):
        digits = rng.choice((1, 2, 2, 3))
        problem = next(iter_problems(digits=digits, ops=("+", "*"), seed=rng.randrange(2**32)))
        # Role headers as the chat template writes them; special tokens themselves are never merged.
        yield f"user\n{prompt_messages(problem)[0].content}\nassistant\n{problem.answer}\n"
    for _ in range(500):
        name, friend = rng.sample(_NAMES, 2)
        item = rng.choice(_ITEMS)
        n, m, k = (rng.randint(2, 60) for _ in range(3))
        yield (
            f"{name} has {n} {item}. She buys {m} more {item} and gives {k} of them to {friend}. "
            f"How many {item} does {name} have now? {name} has {n} + {m} - {k} = {n + m - k} {item}.\n"
            f"#### {n + m - k}"
        )
        yield rng.choice(_QUESTIONS).format(name=name, friend=friend, item=item, n=n, m=m, k=k)
        numbers = [rng.randint(1, 99) for _ in range(rng.randint(3, 4))]
        yield (
            f"Using the numbers {numbers}, create an equation that equals {rng.randint(10, 200)}. "
            "You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. "
            "Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags, "
            f"for example <answer> ({numbers[0]} + {numbers[1]}) / {numbers[2]} </answer>."
        )
    for _ in range(50):
        yield _PROSE
        yield _CODE


def build_tokenizer(recipe: TinyRecipe) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer and wrap it with special tokens and the chat template."""
    tokenizer = Tokenizer(models.BPE())
    # Digits first, one per pre-token, so no merge ever spans two digits; then GPT-2 style byte-level.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=[PAD_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(recipe.seed), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        chat_template=CHAT_TEMPLATE,
        model_max_length=recipe.context_length,
    )


# ---------------------------------------------------------------------------------------------
# Model and warm-up


def build_untrained_model(recipe: TinyRecipe, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """A randomly initialised float32 Qwen2 sized by the recipe (seed it before calling)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.context_length,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def _prompt_ids(tokenizer: PreTrainedTokenizerFast, problem: ArithmeticProblem) -> list[int]:
    messages = [m.model_dump() for m in prompt_messages(problem)]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def answer_batch(
    tokenizer: PreTrainedTokenizerFast, problems: Sequence[ArithmeticProblem]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chat prompt + answer + eos, right-padded: (input_ids, attention_mask, labels), each (B, T).

    `labels` is -100 except on the answer and the closing ``<|im_end|>``: the model learns what
    to answer and when to stop, never to predict the prompt.
    """
    rows, targets = [], []
    for problem in problems:
        prompt = _prompt_ids(tokenizer, problem)
        answer = tokenizer.encode(f"{problem.answer}{IM_END}", add_special_tokens=False)
        rows.append(prompt + answer)
        targets.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # (B, T)
    labels = torch.full((len(rows), width), -100)  # (B, T)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, (row, target) in enumerate(zip(rows, targets, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(target)
        attention_mask[i, : len(row)] = 1
    return input_ids, attention_mask, labels


def answer_logprobs(
    model: Qwen2ForCausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Log-probability (temperature 1) of each row's labelled tokens, summed per row: (B,).

    Only the labelled positions go through the LM head (a quarter of the tiny model's FLOPs
    at this vocabulary), not every prompt position as the model's own `labels=` loss would.
    """
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
    targets = labels[:, 1:]  # (B, T-1): position t predicts token t+1
    predicting = targets != -100  # (B, T-1)
    logits = model.lm_head(hidden[:, :-1][predicting])  # (N, V)
    token_logprobs = -torch.nn.functional.cross_entropy(logits, targets[predicting], reduction="none")  # (N,)
    rows = predicting.nonzero()[:, 0]  # (N,) row of each labelled token
    return torch.zeros(len(input_ids)).index_add(0, rows, token_logprobs)


@torch.no_grad()
def expected_accuracy(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: Sequence[ArithmeticProblem]
) -> float:
    """Mean probability that one temperature-1 sample is exactly ``answer<|im_end|>``.

    This is the expectation of sampled accuracy (up to the rare correct completions that are not
    exactly the answer, e.g. "68 apples"), from one forward pass and free of sampling noise, which
    is why the warm-up steers by it.
    """
    was_training = model.training
    model.eval()
    probability = answer_logprobs(model, *answer_batch(tokenizer, problems)).exp().mean().item()
    model.train(was_training)
    return probability


def train_warmup(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, recipe: TinyRecipe
) -> list[dict[str, float]]:
    """Supervised warm-up on train-split additions until validation accuracy reaches the target.

    Every `check_every` steps (`check_every_near_target` once past half the target) the expected
    sampled accuracy on validation problems (train split, kept out of the warm-up stream) is
    measured; the warm-up stops at the first check at or above `target_accuracy`, or after
    `max_steps`. Why a measurement and not a fixed step count: the accuracy idles at a few
    percent for a long time, then climbs steeply once the model starts adding digit by digit
    (docs/models.md), and where that climb starts moves with the seed and with the
    floating-point rounding of the CPU; a step count tuned on one machine could overshoot or stop
    short on another. Returns the checks: step, mean loss since
    the previous check, expected accuracy.
    """
    validation = sample_problems(
        recipe.validation_problems, digits=recipe.digits, split="train", seed=recipe.seed + 1
    )
    held_back = {p.problem_id for p in validation}
    stream = (
        p
        for p in iter_problems(digits=recipe.digits, ops=("+",), split="train", seed=recipe.seed)
        if p.problem_id not in held_back
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=recipe.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(1, recipe.warmup_steps))
    )
    checks: list[dict[str, float]] = []
    losses: list[float] = []
    model.train()
    for step in range(1, recipe.max_steps + 1):
        batch = answer_batch(tokenizer, [next(stream) for _ in range(recipe.batch_size)])
        # Token mean over every answer token of the batch, as the model's own `labels=` loss.
        loss = -answer_logprobs(model, *batch).sum() / (batch[2] != -100).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        near_target = bool(checks) and checks[-1]["expected_accuracy"] >= recipe.target_accuracy / 2
        every = recipe.check_every_near_target if near_target else recipe.check_every
        if step % every == 0 or step == recipe.max_steps:
            accuracy = expected_accuracy(model, tokenizer, validation)
            checks.append({"step": step, "loss": sum(losses) / len(losses), "expected_accuracy": accuracy})
            losses.clear()
            if accuracy >= recipe.target_accuracy:
                break
    model.eval()
    return checks


@torch.no_grad()
def evaluate_accuracy(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    problems: Sequence[ArithmeticProblem],
    *,
    sample: bool,
    seed: int = 0,
    batch_size: int = 256,
    max_new_tokens: int = 8,
) -> float:
    """Share of `problems` answered right by `generate`: sampled at temperature 1 (no top-k/top-p) or
    greedy."""
    was_training = model.training
    model.eval()
    correct = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            batch = tokenizer.pad(
                {"input_ids": [_prompt_ids(tokenizer, p) for p in chunk]},
                padding_side="left",
                return_tensors="pt",
            )
            output = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=sample,
                temperature=1.0 if sample else None,
                top_k=0 if sample else None,
                top_p=1.0 if sample else None,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            completions = tokenizer.batch_decode(
                output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
            )
            correct += sum(score(text, p) for text, p in zip(completions, chunk, strict=True))
    model.train(was_training)
    return correct / max(1, len(problems))


# ---------------------------------------------------------------------------------------------
# Build, ship and verify


@contextlib.contextmanager
def _build_settings(recipe: TinyRecipe) -> Iterator[None]:
    """Fixed threads, deterministic kernels and a seeded RNG for the build; restored afterwards."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def _processor_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def build_tiny_model(output_dir: str | Path, recipe: TinyRecipe = TINY_MODELS["arithmetic"]) -> dict:
    """Build the model and tokenizer into `output_dir` (save_pretrained) and return its build info.

    Deterministic on one machine: the same recipe, processor features, thread count and library
    versions give the same bytes. Float rounding differs between processors, so another machine
    builds other weights; that is why the build ships with llmrl. The build info (written to
    `build_info.json`) holds the measured figures and the machine; `SHA256SUMS`, written last,
    marks a complete folder.
    """
    output_dir = Path(output_dir)
    started = time.perf_counter()
    with _build_settings(recipe):
        tokenizer = build_tokenizer(recipe)
        model = build_untrained_model(recipe, tokenizer)
        checks = train_warmup(model, tokenizer, recipe)
        heldout = sample_problems(recipe.eval_problems, digits=recipe.digits, split="test", seed=recipe.seed)
        sampled = evaluate_accuracy(model, tokenizer, heldout, sample=True, seed=recipe.seed)
        greedy = evaluate_accuracy(model, tokenizer, heldout, sample=False)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    info = {
        "recipe_version": RECIPE_VERSION,
        "recipe_id": recipe.recipe_id,
        "recipe": dataclasses.asdict(recipe),
        "build_seconds": round(time.perf_counter() - started, 1),
        "params": count_parameters(model),
        "vocab_size": len(tokenizer),
        "warmup_steps_run": checks[-1]["step"] if checks else 0,
        "reached_target": bool(checks) and checks[-1]["expected_accuracy"] >= recipe.target_accuracy,
        "heldout_problems": len(heldout),
        "heldout_sampled_accuracy": sampled,
        "heldout_greedy_accuracy": greedy,
        "checks": checks,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "processor": _processor_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    (output_dir / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    write_checksums(output_dir)
    return info


def describe_differences(shipped: Path, rebuilt: Path) -> list[str]:
    """How `rebuilt` differs from `shipped`, a line per difference; empty when their files are equal.

    `build_info.json` always differs (the build time) and is compared by its figures instead.
    """
    names = sorted((set(read_checksums(shipped)) | set(read_checksums(rebuilt))) - {BUILD_INFO})
    in_both = [n for n in names if (shipped / n).is_file() and (rebuilt / n).is_file()]
    differing = [
        n for n in names if n not in in_both or (shipped / n).read_bytes() != (rebuilt / n).read_bytes()
    ]
    if not differing:
        return []
    lines = []
    old, new = (json.loads((folder / BUILD_INFO).read_text()) for folder in (shipped, rebuilt))
    lines += [
        f"recipe.{field}: {old['recipe'].get(field)} -> {value}"
        for field, value in new["recipe"].items()
        if old["recipe"].get(field) != value
    ]
    for key in (
        "processor",
        "cpu_capability",
        "torch_version",
        "transformers_version",
        "tokenizers_version",
        "warmup_steps_run",
        "heldout_sampled_accuracy",
        "heldout_greedy_accuracy",
    ):
        if old.get(key) != new.get(key):
            lines.append(f"{key}: {old.get(key)} -> {new.get(key)}")
    for name in differing:
        if name not in in_both:
            lines.append(f"{name}: in one build only")
        elif name == "model.safetensors":
            lines.append(_weight_differences(shipped / name, rebuilt / name))
        elif name == "tokenizer.json":
            lines.append(_tokenizer_differences(shipped / name, rebuilt / name))
        else:
            lines.append(f"{name}: differs")
    return lines


def _weight_differences(shipped: Path, rebuilt: Path) -> str:
    old, new = load_file(shipped), load_file(rebuilt)
    if old.keys() != new.keys() or any(old[k].shape != new[k].shape for k in old):
        return "model.safetensors: other tensor names or shapes"
    gaps = {k: (old[k] - new[k]).abs().max().item() for k in old}
    largest = max(gaps, key=gaps.__getitem__)
    squared = sum(((old[k] - new[k]) ** 2).sum().item() for k in old)
    norm = sum((old[k] ** 2).sum().item() for k in old)
    return (
        f"model.safetensors: {sum(g > 0 for g in gaps.values())} of {len(gaps)} tensors differ; largest "
        f"difference {gaps[largest]:.3g} in {largest}; relative L2 difference {(squared / norm) ** 0.5:.3g}"
    )


def _tokenizer_differences(shipped: Path, rebuilt: Path) -> str:
    old, new = (json.loads(path.read_text())["model"] for path in (shipped, rebuilt))
    if old["vocab"] == new["vocab"] and old["merges"] == new["merges"]:
        return "tokenizer.json: differs outside the vocabulary and merges"
    moved = sum(new["vocab"].get(token) != token_id for token, token_id in old["vocab"].items())
    merges = "equal" if old["merges"] == new["merges"] else "differ"
    return f"tokenizer.json: {moved} of {len(old['vocab'])} tokens missing or renumbered; merges {merges}"


def rebuild(name: str, *, replace: bool) -> tuple[Path | None, list[str]]:
    """Build `tiny://name` anew and compare it with the shipped build; with `replace`, ship the new one.

    Returns the shipped folder (None when `replace` is off) and the differences found.
    """
    recipe = recipe_for(name)
    shipped = shipped_folder(name)
    shipped.parent.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=shipped.parent) as staging:
        build_tiny_model(staging, recipe)
        has_shipped = (shipped / CHECKSUMS).is_file()
        differences = (
            describe_differences(shipped, Path(staging)) if has_shipped else ["no shipped build yet"]
        )
        if not replace:
            return None, differences
        move_into_place(Path(staging), shipped)  # the staging folder is gone: its cleanup has nothing to do
    return shipped, differences


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmrl.models.tiny_build", description=__doc__.split("\n")[0]
    )
    parser.add_argument("name", nargs="?", default="arithmetic", choices=sorted(TINY_MODELS))
    parser.add_argument(
        "--rebuild", action="store_true", help="build anew and compare with the shipped build"
    )
    parser.add_argument(
        "--replace", action="store_true", help="with --rebuild: ship the new build in its place"
    )
    parser.add_argument("--problems", type=int, default=256, help="held-out problems to evaluate on")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out sample and of sampling")
    args = parser.parse_args(argv)
    if args.replace and not args.rebuild:
        parser.error("--replace needs --rebuild")

    if args.rebuild:
        print(f"building tiny://{args.name} anew (about a minute)", flush=True)
        shipped, differences = rebuild(args.name, replace=args.replace)
        print(
            "\n".join(["the new build differs from the shipped one:", *(f"  {line}" for line in differences)])
            if differences
            else "the new build is byte for byte the shipped one"
        )
        if shipped is not None:
            print(f"shipped the new build in {shipped}")
        elif differences:
            return 1
    path = tiny_model_path(args.name)
    info = json.loads((path / BUILD_INFO).read_text())
    model = Qwen2ForCausalLM.from_pretrained(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    recipe = recipe_for(args.name)
    heldout = sample_problems(args.problems, digits=recipe.digits, split="test", seed=args.seed)
    sampled = evaluate_accuracy(model, tokenizer, heldout, sample=True, seed=args.seed)
    greedy = evaluate_accuracy(model, tokenizer, heldout, sample=False)
    print(f"model:            tiny://{args.name} at {path} (checksums verified)")
    print(
        f"built on:         {info['processor']} ({info['cpu_capability']}), torch {info['torch_version']}, "
        f"{info['build_seconds']} s on {recipe.threads} thread(s)"
    )
    print(f"parameters:       {info['params']:,}")
    print(f"held-out {recipe.digits}-digit addition, {len(heldout)} problems, seed {args.seed}:")
    print(f"  sampled (T=1):  {sampled:.1%}")
    print(f"  greedy:         {greedy:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
