"""Run config: defaults, YAML loading, --set overrides, and errors that name path and file."""

from pathlib import Path

import pytest
import yaml

from llmrl.config import (
    DEMO_CONFIG,
    ConfigError,
    RunConfig,
    apply_overrides,
    config_from_dict,
    demo_config,
    dump_config,
    load_config,
)

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
MINIMAL = {"environments": [{"agent_type": "arithmetic"}]}


def _write(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_there_are_example_configs():
    assert EXAMPLES, "examples/ must ship at least one config"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_loads(path):
    config = load_config(path)
    assert config.environments


def test_demo_config_is_the_tiny_model_on_arithmetic():
    config = load_config(None)
    assert config == demo_config()
    assert config.model.spec == "tiny://arithmetic"
    assert [e.agent_type for e in config.environments] == ["arithmetic"]


def test_the_arithmetic_example_is_the_packaged_demo_file():
    example = Path(__file__).parents[2] / "examples" / "arithmetic.yaml"
    assert example.resolve() == DEMO_CONFIG.resolve()


def test_every_field_has_a_docstring():
    def check(model, prefix):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no docstring"
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, RunConfig.__mro__[1]):
                check(annotation, f"{prefix}{name}.")

    check(RunConfig, "")


def test_dump_round_trips(tmp_path):
    config = load_config(None, ["training.steps=3", "algorithm.kl_beta=0.04"])
    reloaded = load_config(_write(tmp_path, dump_config(config)))
    assert reloaded == config


def test_overrides_parse_yaml_values(tmp_path):
    config = load_config(
        _write(tmp_path, MINIMAL),
        [
            "training.lr=1e-4",
            "training.steps=7",
            "logging.tensorboard=false",
            "evaluation.ks=[1, 2]",
            "environments.0.agent_args.digits=3",
            "inference.generation.temperature=0.5",
            "algorithm.dual_clip=null",
        ],
    )
    assert config.training.lr == 1e-4
    assert config.training.steps == 7
    assert config.logging.tensorboard is False
    assert config.evaluation.ks == [1, 2]
    assert config.environments[0].agent_args == {"digits": 3}
    assert config.inference.generation.temperature == 0.5


def test_apply_overrides_does_not_mutate_input():
    data = {"training": {"lr": 1.0}}
    assert apply_overrides(data, ["training.lr=2"]) == {"training": {"lr": 2}}
    assert data == {"training": {"lr": 1.0}}


def test_wrong_type_names_path_and_file(tmp_path):
    path = _write(tmp_path, {**MINIMAL, "training": {"lr": "fast"}})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"training.lr: expected a number, got 'fast' (in {path})"


def test_override_with_wrong_type_names_path():
    with pytest.raises(
        ConfigError, match=r"^training\.steps: expected an integer, got 'many' \(in built-in demo"
    ):
        load_config(None, ["training.steps=many"])


def test_unknown_key_suggests_the_close_match(tmp_path):
    path = _write(tmp_path, {**MINIMAL, "training": {"learning_rate": 1e-5, "step": 3}})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "training.step: unknown key (did you mean 'training.steps'?)" in message
    assert "training.learning_rate: unknown key" in message
    assert str(path) in message


def test_unknown_section_lists_valid_sections(tmp_path):
    with pytest.raises(ConfigError, match=r"^zzz: unknown key; valid keys here: seed, run_dir"):
        load_config(_write(tmp_path, {**MINIMAL, "zzz": {}}))


def test_removed_compile_option_is_an_unknown_key(tmp_path):
    # `inference.compile` (AOTInductor-compiled engine steps) was removed: old configs fail loudly.
    with pytest.raises(ConfigError, match=r"^inference\.compile: unknown key; valid keys here: type, "):
        load_config(_write(tmp_path, {**MINIMAL, "inference": {"compile": True}}))


def test_bad_nested_list_entry_is_located(tmp_path):
    data = {"environments": [{"agent_type": "arithmetic"}, {"agent_type": "countdown", "weight": -1}]}
    with pytest.raises(ConfigError, match=r"environments\[1\]\.weight: .*greater than or equal to 0"):
        load_config(_write(tmp_path, data))


def test_literal_field_lists_choices():
    with pytest.raises(
        ConfigError, match=r"algorithm\.advantage_estimator: expected one of 'grpo', 'dr_grpo' or 'rloo'"
    ):
        load_config(None, ["algorithm.advantage_estimator=ppo"])


def test_what_a_signal_does_is_one_of_two():
    assert load_config(None, []).checkpoint.on_signal == "finish_step"  # as Ctrl-C always did
    assert load_config(None, ["checkpoint.on_signal=save_now"]).checkpoint.on_signal == "save_now"
    # A grace in seconds is what a scheduler gives, not what the run does with it.
    with pytest.raises(
        ConfigError, match=r"^checkpoint\.on_signal: expected one of 'finish_step' or 'save_now', got 30 "
    ):
        load_config(None, ["checkpoint.on_signal=30"])


def test_missing_environments_is_reported():
    with pytest.raises(ConfigError, match=r"^environments: required field is missing"):
        config_from_dict({})


def test_cross_field_checks():
    with pytest.raises(
        ConfigError, match=r"evaluation\.ks: every k must be in 1\.\.samples_per_prompt \(4\)"
    ):
        load_config(None, ["evaluation.samples_per_prompt=4", "evaluation.ks=[1, 8]"])
    with pytest.raises(ConfigError, match="env ids must be unique"):
        config_from_dict({"environments": [{"agent_type": "arithmetic"}, {"agent_type": "arithmetic"}]})
    with pytest.raises(ConfigError, match="at least one environment needs weight > 0"):
        config_from_dict({"environments": [{"agent_type": "arithmetic", "evaluation_only": True}]})


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.lr", "expected key=value"),
        ("=3", "expected key=value"),
        ("training..lr=3", "empty component"),
        ("environments.5.weight=1", "needs an index 0..0"),
        ("training.lr=[1, ", "not valid YAML"),
    ],
)
def test_malformed_overrides(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_override_below_a_value_is_refused(tmp_path):
    path = _write(tmp_path, {**MINIMAL, "training": {"lr": 1e-5}})
    with pytest.raises(ConfigError, match="training.lr is a value, not a section"):
        load_config(path, ["training.lr.x=3"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "training: [1,"))
    with pytest.raises(ConfigError, match="expected a mapping of sections, got list"):
        load_config(_write(tmp_path, "- 1\n- 2\n"))


def test_configuration_reference_is_up_to_date():
    from llmrl.config import reference_markdown

    doc = Path(__file__).parents[2] / "docs" / "configuration.md"
    assert doc.read_text() == reference_markdown(), (
        "regenerate: python -m llmrl.config > docs/configuration.md"
    )


@pytest.mark.parametrize(
    ("generation_args", "evaluation_only", "message"),
    [
        (
            {"repetition_penalty": 1.2},
            False,
            r"environments\[0\] \(arithmetic\): \{'repetition_penalty': 1.2\} change",
        ),
        ({"min_tokens": 3, "presence_penalty": 0.5}, False, "'presence_penalty': 0.5, 'min_tokens': 3"),
        ({"temperature": 0}, False, "temperature 0"),
        ({"repetition_penalty": 1.2}, True, None),
        ({"temperature": 0.6, "top_k": 20, "min_p": 0.05}, False, None),
    ],
)
def test_trained_environments_may_only_use_sampling_options_the_trainer_follows(
    generation_args, evaluation_only, message
):
    environments = [
        {
            "agent_type": "arithmetic",
            "evaluation_only": evaluation_only,
            "agent_args": {"generation_args": generation_args},
        }
    ]
    if evaluation_only:
        environments.append({"agent_type": "countdown"})
    if message is None:
        config_from_dict({"environments": environments})
        return
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"environments": environments})


def test_a_saved_config_with_the_old_vllm_bucket_setting_loads_as_the_one_bucket_setting(tmp_path, caplog):
    from llmrl.config import load_config

    saved = tmp_path / "config.yaml"
    saved.write_text(
        "environments: [{agent_type: arithmetic}]\n"
        "inference: {weight_sync_bucket_mb: 512, vllm: {transport: http, bucket_mb: 64}}\n"
    )
    with caplog.at_level("WARNING"):
        config = load_config(saved)
    assert config.inference.weight_sync_bucket_mb == 64  # the smaller: every bound the run had still holds
    assert "inference.vllm.bucket_mb is now inference.weight_sync_bucket_mb" in caplog.text
    assert "bucket_mb" not in config.inference.vllm.model_dump()
