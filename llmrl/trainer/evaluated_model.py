"""What `llmrl eval` evaluates, told in one line, and where its results go.

Anything a run produced can be evaluated: a run folder stands for its latest complete checkpoint
(torn newer ones are set aside: `llmrl.trainer.checkpoint.latest_checkpoint`); a checkpoint (refused
when torn) for its ``model/`` folder or, in a LoRA run, its ``adapter/`` merged onto the run's base
model (the checkpoint config's `model.spec`); a PEFT adapter folder for itself merged onto its base
(inside a checkpoint, the checkpoint's base; elsewhere its ``base_model_name_or_path``). Any other
folder is a Hugging Face model folder (an export), and anything else a model spec (``tiny://NAME``,
a hub id). A run's config without a model to evaluate stands for the run's latest checkpoint: its
`model.spec` is what training started from, evaluated only while the run has no checkpoint.

The results of a checkpoint go into its run's folder, named after the checkpoint
(``eval-step_000300.json``), never into another run's folder, and no evaluation of another
checkpoint or model replaces them; a model of no run goes into the folder of the run whose config
evaluated it, if any, else into the current folder, as ``eval-<its name>.json``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from llmrl.config import ConfigError, ModelConfig, RunConfig, load_config, training_hint
from llmrl.errors import UserError
from llmrl.trainer import checkpoint as ckpt
from llmrl.trainer.lora import ADAPTER_FOLDER, merge_adapter
from llmrl.weights.adapters import ADAPTER_CONFIG

_LONGEST_NAME = 120
"""Characters of a results file's name kept from the evaluated model's (file names stop at 255)."""


@dataclass(frozen=True)
class EvaluatedModel:
    """A model to evaluate: what to load, and the checkpoint and run it comes from, if any."""

    description: str
    """What is evaluated, in words (the line `llmrl eval` starts with)."""
    name: str
    """The path or spec it was named by; results of a model of no checkpoint are named after it."""
    spec: str
    """The model folder or spec to load; a LoRA adapter's base model."""
    adapter: Path | None = None
    """A LoRA adapter folder (PEFT's format), evaluated merged onto `spec`."""
    checkpoint: Path | None = None
    """The run checkpoint it is, if any."""
    run_dir: Path | None = None
    """The run folder it comes from, if any: its results go there."""

    @property
    def run_config(self) -> Path | None:
        """The config the checkpoint was trained with."""
        return self.checkpoint / "config.yaml" if self.checkpoint is not None else None

    def results_path(self, config_run_dir: str | Path | None) -> Path:
        """Where its results go: into its own run's folder, else into the folder of the run whose
        config (`config_run_dir`) evaluated it, else into the current folder."""
        if self.checkpoint is not None and self.run_dir is not None:
            return self.run_dir / f"eval-{self.checkpoint.name}.json"
        folder = self.run_dir or (Path(config_run_dir) if config_run_dir is not None else Path())
        return folder / f"eval-{file_name_part(self.name)}.json"

    @contextmanager
    def served(self, settings: ModelConfig) -> Iterator[ModelConfig]:
        """The model section to serve it with: `settings` (dtype, attention, remote code) with `spec`
        this model and no `lora` (what is served is a plain model). A LoRA adapter is merged onto
        its base into a temporary folder (in `settings.dtype`), removed on leaving."""
        if self.adapter is None:
            yield settings.model_copy(update={"spec": self.spec, "lora": None})
            return
        # The merged folder holds a whole model; tempfile honours $TMPDIR where /tmp is too small.
        with tempfile.TemporaryDirectory(prefix="llmrl-eval-merged-") as folder:
            merge_adapter(
                self.adapter,
                self.spec,
                folder,
                dtype=settings.dtype,
                trust_remote_code=settings.trust_remote_code,
            )
            yield settings.model_copy(update={"spec": folder, "lora": None})


def find_evaluated_model(path_or_spec: str) -> EvaluatedModel:
    """The model a run, checkpoint, adapter or model folder, or a model spec stands for."""
    path = Path(path_or_spec).expanduser()
    if not path.is_dir():
        return EvaluatedModel(description=path_or_spec, name=path_or_spec, spec=path_or_spec)
    if path.name in (ADAPTER_FOLDER, "model") and ckpt.checkpoint_step(path.parent) is not None:
        return _checkpoint_model(path_or_spec, path.parent, latest=False)
    if (path / ADAPTER_CONFIG).is_file():
        return _adapter_model(path_or_spec, path)
    if ckpt.checkpoint_step(path) is not None:
        return _checkpoint_model(path_or_spec, path, latest=False)
    latest = ckpt.latest_checkpoint(path)
    if latest is not None:
        return _checkpoint_model(path_or_spec, latest[1], latest=True)
    if (path / "config.json").is_file():
        return EvaluatedModel(
            description=f"{path_or_spec} (Hugging Face model folder)", name=path_or_spec, spec=path_or_spec
        )
    if (path / "config.yaml").is_file():
        raise UserError(f"{path_or_spec}: this run folder has no checkpoint yet{training_hint(path)}")
    raise UserError(
        f"{path_or_spec}: not a run or checkpoint folder, a LoRA adapter folder ({ADAPTER_CONFIG}) "
        "or a Hugging Face model folder (config.json)"
    )


MERGED_START_MODELS = "start_models"
"""The folder of a run folder that holds the LoRA adapters it starts from, merged onto their bases."""


def with_model_folder(config: RunConfig, *, merge_lora: bool = False) -> RunConfig:
    """`config` with a run or checkpoint `model.spec` replaced by the model folder it stands for (a run
    folder: its latest checkpoint's), so that all that loads the model (the policy, its KL reference,
    the inference engine, the agents' tokenizers) and the run's resumes start from the same weights,
    even while that run trains on. A LoRA checkpoint or adapter stands for its merged model, which must
    outlive the run: with `merge_lora` (a run that trains) it is written into the run folder
    (`merged_start_model`), else refused with how to write it (`llmrl export`)."""
    spec = config.model.spec
    if not Path(spec).expanduser().is_dir():
        return config
    try:
        model = find_evaluated_model(spec)
    except UserError as error:
        raise ConfigError(f"model.spec: {error}") from None
    folder = model.spec
    if model.adapter is not None:
        if not merge_lora:
            raise ConfigError(
                f"model.spec: {spec} holds a LoRA adapter, not a whole model: write it merged onto its base "
                f"({model.spec}) with `llmrl export {spec} FOLDER` and set model.spec to FOLDER"
            )
        folder = str(merged_start_model(model, Path(config.run_dir), config.model.trust_remote_code))
    return config.model_copy(update={"model": config.model.model_copy(update={"spec": folder})})


def merged_start_model(model: EvaluatedModel, run_dir: Path, trust_remote_code: bool = False) -> Path:
    """`model`'s LoRA adapter merged onto its base (in float32, as master weights are kept) in
    `run_dir`'s `MERGED_START_MODELS`, in a folder named after the adapter's checkpoint or folder, so
    that another one is another model spec, which a resume notices. Written once: each process of a
    run merges into a scratch folder, and the first to finish renames it into place."""
    assert model.adapter is not None
    folder = run_dir / MERGED_START_MODELS / file_name_part(str(model.checkpoint or model.adapter))
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(
        dir=folder.parent, prefix=".merging-", ignore_cleanup_errors=True
    ) as scratch:
        merge_adapter(
            model.adapter, model.spec, scratch, dtype="float32", trust_remote_code=trust_remote_code
        )
        try:
            os.rename(scratch, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not another process that was first
                raise
    return folder


def run_model(run_dir: str | Path, untrained_spec: str) -> EvaluatedModel:
    """What a run's config stands for: the run's latest checkpoint, or while it has none, the untrained
    `model.spec` it starts from."""
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is None:
        return EvaluatedModel(
            description=f"the untrained model.spec {untrained_spec} ({run_dir} has no checkpoint)",
            name=untrained_spec,
            spec=untrained_spec,
            run_dir=Path(run_dir),
        )
    return _checkpoint_model(
        str(run_dir),
        latest[1],
        latest=True,
        owner=f"{run_dir}'s trained weights",
        note=f"not the untrained model.spec {untrained_spec}",
    )


def _checkpoint_model(
    name: str, checkpoint: Path, *, latest: bool, owner: str | None = None, note: str | None = None
) -> EvaluatedModel:
    """The checkpoint's model, described as `owner`'s (default: `name`) with a last `note`; one named by
    its folder (not `latest`, which is checked) is refused when torn."""
    if not latest:
        ckpt.check_named_checkpoint(checkpoint)
    details = [f"checkpoint step {ckpt.checkpoint_step(checkpoint)}" + (", its latest" if latest else "")]
    adapter = checkpoint / ADAPTER_FOLDER
    if (adapter / ADAPTER_CONFIG).is_file():
        spec = load_config(checkpoint / "config.yaml").model.spec
        details.append(f"LoRA adapter merged onto {spec}")
    else:
        spec, adapter = str(checkpoint / "model"), None
    if note is not None:
        details.append(note)
    return EvaluatedModel(
        description=f"{owner or name} ({', '.join(details)})",
        name=name,
        spec=spec,
        adapter=adapter,
        checkpoint=checkpoint,
        run_dir=ckpt.checkpoint_run_dir(checkpoint),
    )


def _adapter_model(name: str, adapter: Path) -> EvaluatedModel:
    base = json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{name}: its {ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    return EvaluatedModel(
        description=f"{name} (LoRA adapter merged onto {base})", name=name, spec=base, adapter=adapter
    )


def file_name_part(name: str) -> str:
    """A model's name as part of a file name: a folder by its path (relative to the current folder
    when inside it, so that two folders named alike stay apart), characters other than letters,
    digits, dots and underscores as dashes; long names keep their end."""
    path = Path(name)
    if path.is_dir():
        absolute = path.resolve()
        name = os.path.relpath(absolute) if absolute.is_relative_to(Path.cwd()) else str(absolute)
    return re.sub(r"[^A-Za-z0-9._]+", "-", name)[-_LONGEST_NAME:].strip("-.") or "model"
