"""The embedded tiny model (llmrl/models/tiny.py, its build llmrl/models/tiny_build.py) and `load_model`
(llmrl/models/loading.py)."""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from llmrl.models import (
    TINY_MODELS,
    ModelSpecError,
    export_model,
    load_model,
    resolve_model_spec,
    tiny,
    tiny_build,
)
from llmrl.models.tiny import BUILD_INFO, CHECKSUMS, TinyRecipe, tiny_model_path
from llmrl.models.tiny_build import IM_END, PAD_TOKEN, build_tiny_model
from llmrl.rewards.arithmetic import ArithmeticProblem, prompt_messages, sample_problems

# A recipe that builds in about a second: same tokenizer and code path, a toy network and 3 steps.
MICRO = dataclasses.replace(
    TinyRecipe(),
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    max_steps=3,
    check_every=2,
    batch_size=4,
    validation_problems=8,
    eval_problems=8,
)


@pytest.fixture(scope="module")
def micro_build(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro-a")
    return path, build_tiny_model(path, MICRO)


@pytest.fixture
def shipped_micro(monkeypatch, tmp_path, micro_build):
    """`tiny://micro` is MICRO, shipped (a copy of its build) under a temporary `SHIPPED_ROOT`."""
    monkeypatch.setitem(TINY_MODELS, "micro", MICRO)
    monkeypatch.setattr(tiny, "SHIPPED_ROOT", tmp_path / "shipped")
    return Path(shutil.copytree(micro_build[0], tmp_path / "shipped" / "micro"))


def file_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name not in (BUILD_INFO, CHECKSUMS)}


# --- build: determinism and cache ------------------------------------------------------------


@pytest.mark.cross_cpu
def test_build_is_bitwise_deterministic(micro_build, tmp_path):
    first, _ = micro_build
    build_tiny_model(tmp_path, MICRO)
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(file_bytes(first))
    assert file_bytes(tmp_path) == file_bytes(first)


def test_build_restores_torch_settings_and_follows_the_seed(micro_build, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(MICRO.threads + 1)  # not the build's own setting
    try:
        torch.manual_seed(123)
        expected_next = torch.rand(1)
        torch.manual_seed(123)
        build_tiny_model(tmp_path, dataclasses.replace(MICRO, seed=1))
        assert torch.rand(1) == expected_next  # the build drew from its own, forked RNG
        assert torch.get_num_threads() == MICRO.threads + 1
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.set_num_threads(threads)
    assert file_bytes(tmp_path)["model.safetensors"] != file_bytes(micro_build[0])["model.safetensors"]


def test_build_info_records_the_run(micro_build):
    path, info = micro_build
    assert json.loads((path / BUILD_INFO).read_text()) == info
    assert info["recipe_id"] == MICRO.recipe_id and info["recipe"]["max_steps"] == 3
    assert [c["step"] for c in info["checks"]] == [2, 3] and info["warmup_steps_run"] == 3
    assert info["heldout_problems"] == 8 and 0.0 <= info["heldout_sampled_accuracy"] <= 1.0
    assert info["params"] == sum(p.numel() for p in load_model(str(path))[0].parameters())


def test_warmup_stops_at_the_first_check_that_reaches_the_target(micro_build):
    model, tokenizer = load_model(str(micro_build[0]))
    checks = tiny_build.train_warmup(
        model, tokenizer, dataclasses.replace(MICRO, target_accuracy=0.0, max_steps=50)
    )
    assert [c["step"] for c in checks] == [MICRO.check_every]
    assert 0.0 < checks[0]["expected_accuracy"] < 1.0 and checks[0]["loss"] > 0


def test_recipe_id_changes_with_the_recipe():
    assert TinyRecipe().recipe_id == TinyRecipe().recipe_id
    assert dataclasses.replace(TinyRecipe(), max_steps=5).recipe_id != TinyRecipe().recipe_id


# --- the shipped build: checksums, recipe, rebuild ---------------------------------------------


def test_the_shipped_build_is_of_the_current_recipe_and_complete():
    path = tiny_model_path("arithmetic")
    assert path == tiny.SHIPPED_ROOT / "arithmetic"
    listed = set(tiny.read_checksums(path))
    assert {"model.safetensors", "tokenizer.json", "config.json", BUILD_INFO} <= listed
    assert listed == {p.name for p in path.iterdir()} - {CHECKSUMS}
    info = json.loads((path / BUILD_INFO).read_text())
    assert info["recipe_id"] == TINY_MODELS["arithmetic"].recipe_id and info["reached_target"]


def test_the_shipped_files_are_package_data():
    """A wheel (not only an editable install) carries the shipped build: pyproject's globs cover it."""
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    section = pyproject.split("[tool.setuptools.package-data]", 1)[1]
    patterns = ast.literal_eval(re.search(r"^llmrl = (\[.*\])$", section, re.M).group(1))
    package = Path(tiny.__file__).parents[1]
    for file in tiny.SHIPPED_ROOT.rglob("*"):
        if file.is_file():
            relative = file.relative_to(package).as_posix()
            assert any(
                fnmatch.fnmatch(relative, pattern) and relative.count("/") == pattern.count("/")
                for pattern in patterns
            ), relative


def test_a_changed_or_missing_file_is_refused_by_name(shipped_micro):
    assert load_model("tiny://micro")[0].config.hidden_size == 32
    tokenizer_file = shipped_micro / "tokenizer.json"
    tokenizer_file.write_text(tokenizer_file.read_text().replace("<|im_end|>", "<|im_stop|>"))
    with pytest.raises(ModelSpecError, match=r"tiny://micro: .*tokenizer.json does not match .*reinstall"):
        load_model("tiny://micro")
    tokenizer_file.unlink()
    with pytest.raises(ModelSpecError, match=r"tokenizer.json is missing"):
        tiny_model_path("micro")
    (shipped_micro / CHECKSUMS).unlink()
    with pytest.raises(ModelSpecError, match=r"SHA256SUMS is missing"):
        tiny_model_path("micro")


def test_a_changed_recipe_asks_for_a_rebuild(shipped_micro, monkeypatch):
    monkeypatch.setitem(TINY_MODELS, "micro", dataclasses.replace(MICRO, max_steps=4))
    with pytest.raises(ModelSpecError, match=r"python -m llmrl.models.tiny_build micro --rebuild --replace"):
        load_model("tiny://micro")


def test_differences_name_the_recipe_weights_and_tokenizer(micro_build, tmp_path):
    other = dataclasses.replace(MICRO, seed=1)
    build_tiny_model(tmp_path, other)
    lines = tiny_build.describe_differences(micro_build[0], tmp_path)
    assert "recipe.seed: 0 -> 1" in lines
    weights = next(line for line in lines if line.startswith("model.safetensors"))
    assert re.search(r"\d+ of \d+ tensors differ; largest difference [\d.e-]+ in model\.", weights), weights
    assert any(line.startswith("tokenizer.json: ") for line in lines), lines
    assert tiny_build.describe_differences(micro_build[0], micro_build[0]) == []


@pytest.mark.cross_cpu
def test_rebuild_compares_and_replace_ships_the_new_build(shipped_micro, monkeypatch, capsys):
    argv = ["micro", "--problems", "4"]
    assert tiny_build.main([*argv, "--rebuild"]) == 0  # the same recipe on the same machine: the same bytes
    assert "byte for byte the shipped one" in capsys.readouterr().out
    monkeypatch.setitem(TINY_MODELS, "micro", dataclasses.replace(MICRO, max_steps=4))
    assert tiny_build.main([*argv, "--rebuild"]) == 1
    out = capsys.readouterr().out
    assert "recipe.max_steps: 3 -> 4" in out and "model.safetensors: " in out
    assert tiny_build.main([*argv, "--rebuild", "--replace"]) == 0
    assert "shipped the new build" in capsys.readouterr().out
    assert json.loads((tiny_model_path("micro") / BUILD_INFO).read_text())["recipe"]["max_steps"] == 4
    assert sorted(p.name for p in shipped_micro.parent.iterdir()) == ["micro"]  # no staging left behind


def test_export_writes_a_plain_folder_that_loads_back(shipped_micro, tmp_path):
    out = export_model("tiny://micro", tmp_path / "exported", dtype="bfloat16")
    exported, tokenizer = load_model(str(out))
    original, _ = load_model("tiny://micro")
    for name, tensor in original.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor.to(torch.bfloat16)), name
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
        "<|im_start|>user"
    )
    with pytest.raises(ValueError, match="must not exist or be empty"):
        export_model("tiny://micro", out)


# --- load_model errors -------------------------------------------------------------------------


def test_unknown_tiny_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"tiny://nope.*valid tiny models: tiny://arithmetic"):
        load_model("tiny://nope")


@pytest.mark.parametrize(
    "spec", ["./no/such/model", "/no/such/model", "~/no-such-model-here/x", "a//b", "x y"]
)
def test_missing_local_folder_is_a_clear_error(spec):
    with pytest.raises(ValueError, match=f"no folder {re.escape(spec)}"):
        load_model(spec)


def test_file_instead_of_folder_is_an_error(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        load_model(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("spec", ["", "   ", None])
def test_empty_spec_is_an_error(spec):
    with pytest.raises(ValueError, match="non-empty string"):
        load_model(spec)


@pytest.mark.parametrize("spec", ["Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "org/model_v1.5"])
def test_hub_ids_pass_through_to_transformers(spec):
    assert resolve_model_spec(spec) == spec


@pytest.mark.parametrize("dtype", ["fp32", "int8", torch.int64])
def test_bad_dtype_names_the_argument(dtype):
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        load_model("tiny://arithmetic", dtype=dtype)


# --- the real tiny://arithmetic ------------------------------------------------------------------


def test_tokenizer_round_trips_any_text(tiny_model):
    _, tokenizer = tiny_model
    for text in [
        "What is 23 + 45?",
        "Natalia sold 48 clips in April.\n\n#### 72",
        "héllo wörld — ünïcode ✓ 😀 中文",
        "def f(x):\n\treturn x ** 2  # square\r\n",
        "   leading and trailing spaces   ",
        "\x00\x7f",
    ]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_tokenizer_splits_digits_one_per_token(tiny_model):
    _, tokenizer = tiny_model
    text = "In 2024, 1234567 + 89 = 1234656 and x10y"
    tokens = [tokenizer.decode([i]) for i in tokenizer.encode(text, add_special_tokens=False)]
    assert all(len(re.findall(r"\d", t)) <= 1 for t in tokens)
    assert [t for t in tokens if t.isdigit()] == list(re.sub(r"\D", "", text))


def test_tokenizer_is_small_and_has_pad_and_eos(tiny_model):
    model, tokenizer = tiny_model
    assert 512 <= len(tokenizer) <= 1024 == TINY_MODELS["arithmetic"].vocab_size
    assert (tokenizer.pad_token, tokenizer.eos_token) == (PAD_TOKEN, IM_END)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    for special in (PAD_TOKEN, "<|im_start|>", IM_END):
        assert len(tokenizer.encode(special, add_special_tokens=False)) == 1
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_chat_template_is_chatml(tiny_model):
    _, tokenizer = tiny_model
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == rendered + "<|im_start|>assistant\n"


def test_prompt_then_answer_tokens_equal_the_whole_text(tiny_model):
    """Trainer and engine concatenate prompt and completion ids; that must equal tokenising the text."""
    _, tokenizer = tiny_model
    messages = [m.model_dump() for m in prompt_messages(ArithmeticProblem.of(23, "+", 45))]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode("68" + IM_END, add_special_tokens=False)
    assert tokenizer.encode(prompt + "68" + IM_END, add_special_tokens=False) == prompt_ids + answer_ids


def test_model_shape_and_size(tiny_model):
    model, tokenizer = tiny_model
    recipe = TINY_MODELS["arithmetic"]
    config = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM" and not model.training
    assert (config.hidden_size, config.num_hidden_layers) == (recipe.hidden_size, recipe.num_layers)
    assert config.max_position_embeddings == recipe.context_length and config.vocab_size == len(tokenizer)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # tied
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert 500_000 <= sum(p.numel() for p in model.parameters()) <= 5_000_000


def test_load_model_honours_dtype(tiny_model_path):
    model, _ = load_model(str(tiny_model_path), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.cross_cpu
def test_warmed_up_model_is_partly_right(tiny_model, tiny_model_path):
    """GRPO needs signal: answers in the right format, some right and some wrong."""
    info = json.loads((tiny_model_path / BUILD_INFO).read_text())
    assert info["reached_target"]
    assert 0.15 <= info["heldout_sampled_accuracy"] <= 0.5
    model, tokenizer = tiny_model
    problems = sample_problems(32, split="test", seed=11)
    batch = tokenizer(
        [
            tokenizer.apply_chat_template(
                [m.model_dump() for m in prompt_messages(p)], tokenize=False, add_generation_prompt=True
            )
            for p in problems
        ],
        add_special_tokens=False,
        return_tensors="pt",
    )
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=6, do_sample=False)
    completions = output[:, batch["input_ids"].shape[1] :]
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    assert all(re.fullmatch(r"\d{2,3}", t) for t in texts), texts
    assert all(tokenizer.eos_token_id in row.tolist() for row in completions)
    assert 0 < sum(int(t) == p.answer for t, p in zip(texts, problems, strict=True)) < len(problems)


def test_unreachable_hub_model_is_a_clear_error():
    from llmrl.models import load_model

    with pytest.raises(
        ValueError,
        match=r"model spec 'llmrl-test/no-such-model': no folder .*; its tokenizer is not in the local cache",
    ):
        load_model("llmrl-test/no-such-model")
