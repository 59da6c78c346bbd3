"""The embedded default model, ``tiny://NAME``: its recipe, and its shipped build checked at every load.

`tiny://arithmetic` is a tiny Qwen2 built from nothing and warmed up on 2-digit addition
(`llmrl.models.tiny_build`; docs/models.md). The build ships inside the package
(`shipped/arithmetic/`, written by `save_pretrained`, with a `SHA256SUMS` checked at every load):
float rounding differs between processors, so a build on each user's machine would give each user
another model. A load also checks that the build is of the code's `TinyRecipe`. Loading needs none
of the build's code (the task, the warm-up); rebuilding (``python -m llmrl.models.tiny_build``) is
for whoever changes the recipe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from llmrl.errors import ModelSpecError

RECIPE_VERSION = 1
"""Bump when the build changes in a way the recipe fields do not capture (corpus, code)."""


@dataclasses.dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines the built model's bytes (with `RECIPE_VERSION` and library versions)."""

    seed: int = 0
    """Seeds the corpus, the initial weights and the warm-up problem stream."""
    vocab_size: int = 1024
    """Target BPE vocabulary size, special tokens included."""
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    context_length: int = 1024
    """Maximum positions (prompt + completion)."""
    max_steps: int = 1500
    """Most warm-up optimiser steps; the warm-up normally stops earlier, at `target_accuracy`."""
    target_accuracy: float = 0.3
    """Stop once the expected sampled (temperature 1) accuracy on validation problems reaches this."""
    check_every: int = 10
    """Warm-up steps between validation checks while accuracy is below half the target."""
    check_every_near_target: int = 2
    """Steps between checks from half the target on, where accuracy climbs fast enough for coarser checks
    to overshoot the target."""
    validation_problems: int = 256
    """Train-split problems held back from the warm-up to steer it."""
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    """Linear learning-rate warm-up; the rate is constant afterwards, so a shorter run equals a prefix of a
    longer one."""
    digits: int = 2
    """Operand size of the warm-up additions."""
    eval_problems: int = 256
    """Held-out problems for the accuracy figures written to build_info.json."""
    threads: int = 1
    """torch threads during the build: fixed, because CPU matmul reduction order depends on it.

    One, because the matmuls are small: a second thread gains little on an idle machine and, on
    a shared one, makes every op wait for a descheduled thread.
    """

    @property
    def recipe_id(self) -> str:
        """Short hash of the recipe and `RECIPE_VERSION`: a build records it, and every load checks it."""
        text = json.dumps({"version": RECIPE_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


TINY_MODELS: dict[str, TinyRecipe] = {"arithmetic": TinyRecipe()}
"""Names accepted after ``tiny://``."""


BUILD_INFO = "build_info.json"
CHECKSUMS = "SHA256SUMS"
SHIPPED_ROOT = Path(__file__).resolve().parent / "shipped"
"""The shipped builds, a folder per `TINY_MODELS` name, installed with the package."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_checksums(folder: Path) -> None:
    """`SHA256SUMS` of every other file in `folder`, in `sha256sum`'s format (``sha256sum -c`` checks it)."""
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.name != CHECKSUMS)
    (folder / CHECKSUMS).write_text("".join(f"{_sha256(f)}  {f.name}\n" for f in files))


def read_checksums(folder: Path) -> dict[str, str]:
    """File name -> SHA-256 hex digest, as `SHA256SUMS` lists them."""
    lines = (folder / CHECKSUMS).read_text().splitlines()
    return {name: digest for digest, name in (line.split(maxsplit=1) for line in lines)}


def verify_build(folder: Path, recipe: TinyRecipe, spec: str) -> None:
    """Raise `ModelSpecError` unless every file in `SHA256SUMS` matches and the build is of `recipe`."""
    reinstall = "the installed llmrl is damaged or was edited: reinstall it"
    if not (folder / CHECKSUMS).is_file():
        raise ModelSpecError(f"{spec}: {folder / CHECKSUMS} is missing; {reinstall}")
    for name, digest in read_checksums(folder).items():
        if not (folder / name).is_file():
            raise ModelSpecError(f"{spec}: {folder / name} is missing; {reinstall}")
        if _sha256(folder / name) != digest:
            raise ModelSpecError(f"{spec}: {folder / name} does not match its {CHECKSUMS} entry; {reinstall}")
    built_from = json.loads((folder / BUILD_INFO).read_text())["recipe_id"]
    if built_from != recipe.recipe_id:
        raise ModelSpecError(
            f"{spec}: the shipped build is of recipe {built_from}, but the code's recipe is "
            f"{recipe.recipe_id}; ship a build of the current recipe with: "
            f"python -m llmrl.models.tiny_build {spec.removeprefix('tiny://')} --rebuild --replace"
        )


def recipe_for(name: str) -> TinyRecipe:
    """The recipe of `tiny://name` (a `ModelSpecError` naming the valid names when there is none)."""
    if name not in TINY_MODELS:
        valid = ", ".join(f"tiny://{n}" for n in sorted(TINY_MODELS))
        raise ModelSpecError(f"unknown model spec 'tiny://{name}'; valid tiny models: {valid}")
    return TINY_MODELS[name]


def shipped_folder(name: str) -> Path:
    """Where the build of `tiny://name` ships (whether or not it is there)."""
    return SHIPPED_ROOT / name


def tiny_model_path(name: str = "arithmetic") -> Path:
    """The shipped folder of `tiny://name`, its checksums and recipe verified."""
    folder = shipped_folder(name)
    verify_build(folder, recipe_for(name), f"tiny://{name}")
    return folder
