"""Run configuration: typed, validated at load time, one docstring per field.

A run is described by one YAML file that maps onto `RunConfig`. Any field can be overridden from
the command line with ``--set section.field=value`` (the value is parsed as YAML, so ``3``,
``1e-5``, ``true`` and ``[1, 2]`` mean what they look like); list items are numbered from 0,
``--set environments.0.agent_args.digits=3`` or ``--set environments[0].agent_args.digits=3``.
Unknown keys and values of the wrong type are `ConfigError`s that name the dotted path of the field
and the file it came from, e.g.::

    training.lr: expected a number, got 'fast' (in examples/arithmetic.yaml)

Relative paths of the files a run reads (`plugins`, `model.spec`,
`inference.vllm.python`, an environment's `data_files`, `eval_data_files`, `path` and
`chat_template`) resolve against the config file's folder when the file exists there, otherwise
against the working directory; `load_config` writes the ones found beside the config as paths from
the working directory. The folders a run writes, `run_dir` and `inference.weights_dir`, are always
relative to the working directory.

From Python (`llmrl.train`), a config may hold the objects themselves where a file names code or
data: a reward function, an agent program (`rollout`), an agent class (`agent_type`), a
`datasets.Dataset` (`dataset`, `eval_dataset`). A saved config writes each as its description
(`describe_python_object`), which is also what a resumed run is compared by.

The defaults are general starting points; the built-in demo (`DEMO_CONFIG`, llmrl/demo.yaml), what
``llmrl train`` runs when given no config file, holds the settings vetted on the built-in arithmetic
task with the tiny model.

The package's modules: `sections` (the base of every section), one module per group of sections
(`model`, `inference`, `environments`, `algorithm`, `training`, `outputs`), `run` (`RunConfig`),
`loading`, `overrides` (``--set``), `errors` (`ConfigError` and its messages) and `reference`
(docs/configuration.md, ``python -m llmrl.config``). Import from the package: `from llmrl.config import X`.
"""

from llmrl.config.algorithm import (
    AdvantageEstimator,
    Aggregation,
    AlgorithmConfig,
    DistillationConfig,
    ISMode,
    KLEstimator,
    RatioLevel,
    StdScope,
    TeacherServerConfig,
)
from llmrl.config.environments import EnvironmentConfig, EvaluationConfig
from llmrl.config.errors import ConfigError
from llmrl.config.inference import (
    DEFAULT_CONCURRENT,
    DEFAULT_ENGINE_TOKENS,
    VLLM_LORA_RANKS,
    InferenceConfig,
    ServeConfig,
    VLLMConfig,
)
from llmrl.config.loading import (
    AGENT_INPUT_PATHS,
    DEMO_CONFIG,
    config_folder_of_missing_spec,
    config_from_dict,
    demo_config,
    dump_config,
    load_config,
    training_hint,
)
from llmrl.config.model import LoraConfig, ModelConfig
from llmrl.config.outputs import CheckpointConfig, LoggingConfig
from llmrl.config.overrides import apply_overrides, parse_override
from llmrl.config.reference import reference_markdown
from llmrl.config.run import RunConfig
from llmrl.config.sections import (
    PYTHON_OBJECT_PREFIXES,
    Section,
    describe_python_object,
    is_python_object_description,
)
from llmrl.config.training import TrainingConfig

__all__ = [
    "AGENT_INPUT_PATHS",
    "DEFAULT_CONCURRENT",
    "DEFAULT_ENGINE_TOKENS",
    "DEMO_CONFIG",
    "PYTHON_OBJECT_PREFIXES",
    "VLLM_LORA_RANKS",
    "AdvantageEstimator",
    "Aggregation",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "DistillationConfig",
    "EnvironmentConfig",
    "EvaluationConfig",
    "ISMode",
    "InferenceConfig",
    "KLEstimator",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "RatioLevel",
    "RunConfig",
    "Section",
    "ServeConfig",
    "StdScope",
    "TeacherServerConfig",
    "TrainingConfig",
    "VLLMConfig",
    "apply_overrides",
    "config_folder_of_missing_spec",
    "config_from_dict",
    "demo_config",
    "describe_python_object",
    "dump_config",
    "is_python_object_description",
    "load_config",
    "parse_override",
    "reference_markdown",
    "training_hint",
]
