"""Training from Python (a notebook, a script): `train` is ``llmrl train`` as a function.

    import llmrl

    summary = llmrl.train("examples/arithmetic.yaml", overrides=["training.steps=20"])

A config given as a `RunConfig` or a mapping may hold, where a file names code or data, the object
itself: a reward function, an agent program, an agent class, a `datasets.Dataset` (docs/python_api.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llmrl.config import RunConfig, apply_overrides, config_from_dict, load_config
from llmrl.trainer import Trainer


def train(
    config: RunConfig | Mapping[str, Any] | str | Path,
    *,
    overrides: Sequence[str] = (),
    resume: bool = False,
) -> dict[str, Any]:
    """Train as ``llmrl train`` does and return the run's summary (`llmrl.trainer.Trainer.run`).

    Args:
        config: a `RunConfig`; a mapping of sections, as a YAML file has them; or the path of a YAML file
            (its relative paths resolve as `llmrl.config.load_config` says).
        overrides: ``key=value`` assignments, as ``--set`` takes them (``training.steps=20``, values parsed
            as YAML).
        resume: continue the run folder's latest checkpoint even if the config changed in what it trains;
            the same call (the same config, the same objects) resumes without it.
    """
    trainer = Trainer(run_config(config, overrides), resume=resume)
    if trainer.resumed and trainer.is_main:
        print(f"resuming {trainer.run_dir} from its checkpoint at step {trainer.step}")
    return trainer.run()


def run_config(
    config: RunConfig | Mapping[str, Any] | str | Path, overrides: Sequence[str] = ()
) -> RunConfig:
    """The validated config `train` runs: `config` with `overrides` applied."""
    assignments = [overrides] if isinstance(overrides, str) else list(overrides)
    if isinstance(config, RunConfig):
        if not assignments:
            return config
        data = config.model_dump(exclude_unset=True)  # objects stay objects; unset fields keep their defaults
        return config_from_dict(apply_overrides(data, assignments), "the RunConfig given, with overrides")
    if isinstance(config, Mapping):
        return config_from_dict(apply_overrides(dict(config), assignments), "the config given to llmrl.train")
    return load_config(config, assignments)
