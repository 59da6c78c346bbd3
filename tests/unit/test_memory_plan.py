"""The memory plan printed before a run, its refusal with settings that fit, and the measured peak."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from llmrl.algorithms.logprobs import token_logprobs
from llmrl.algorithms.packing import build_batch
from llmrl.config import ConfigError
from llmrl.models.shape import ModelShape
from llmrl.trainer import memory as memory_module
from llmrl.trainer.memory import (
    GB,
    ColocatedEngine,
    MemoryPlan,
    MemorySettings,
    PeakMemory,
    device_memory,
    plan_memory,
    size_engine,
)
from llmrl.trainer.policy import plan_training_memory
from llmrl.trainer.trainer import Trainer


def meta_model(tied: bool = False) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


def settings(**changes) -> MemorySettings:
    base = MemorySettings(
        master_dtype=torch.float32,
        compute_dtype=torch.bfloat16,
        world_size=1,
        micro_batch_tokens=4096,
        row_tokens=512,
        activation_checkpointing=False,
        reference_model=False,
        engine_tokens=8192,
    )
    return dataclasses.replace(base, **changes)


def test_the_shape_counts_every_parameter_once_and_sizes_the_layers():
    for tied in (False, True):
        model = meta_model(tied)
        shape = ModelShape.of(model)
        assert shape.parameters == sum(p.numel() for p in model.parameters())  # a tied head counts once
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        assert shape.largest_block == layer
        assert shape.outside_blocks == shape.parameters - 3 * layer
        assert (shape.layers, shape.hidden, shape.kv_channels) == (3, 64, 32)


def test_sharded_terms_divide_by_the_processes_and_the_engine_is_rank_zeros():
    model = meta_model()
    one = plan_memory(model, settings(), "cpu").terms(rank0=True)
    plan = plan_memory(model, settings(world_size=4), "cpu")
    rank0, other = plan.terms(rank0=True), plan.terms(rank0=False)
    parameters = sum(p.numel() for p in model.parameters())
    assert (
        one["parameters"] == parameters * 4 and one["optimizer"] == parameters * 12
    )  # moments, step temporary
    for name in ("parameters", "gradients", "optimizer"):
        assert rank0[name] == pytest.approx(one[name] / 4, abs=1)
    assert rank0["engine"] > 0 and "engine" not in other
    assert "engine" not in plan_memory(model, settings(engine_tokens=None), "cpu").terms(rank0=True)
    assert one["gathered"] == parameters * 2  # autocast's bfloat16 casts of float32 weights
    assert "gathered" not in plan_memory(model, settings(compute_dtype=torch.float32), "cpu").terms(
        rank0=True
    )


def test_activation_checkpointing_lowers_the_activations_and_the_reference_adds_a_copy():
    model = meta_model()
    kept = plan_memory(model, settings(), "cpu").terms(rank0=True)
    checkpointed = plan_memory(model, settings(activation_checkpointing=True), "cpu").terms(rank0=True)
    assert checkpointed["activations"] < kept["activations"]
    half = plan_memory(model, settings(micro_batch_tokens=2048), "cpu").terms(rank0=True)
    assert half["activations"] < kept["activations"]
    with_reference = plan_memory(model, settings(reference_model=True), "cpu").terms(rank0=True)
    assert with_reference["reference"] == sum(p.numel() for p in model.parameters()) * 2


def saved_activation_bytes(layers: int, autocast: bool) -> tuple[int, int]:
    """Bytes autograd keeps in the trainer's forward of packed rows (weights and their casts left out),
    and the tokens of the micro-batch."""
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=520,
    )
    model = Qwen2ForCausalLM(config).train()
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 512, (128,), generator=generator).tolist() for _ in range(8)]
    batch = build_batch(sequences, [[0, 1, 2, 3], [4, 5, 6, 7]])
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) not in weight_shapes:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        token_logprobs(model, batch)
    return sum(saved.values()), batch.input_ids.numel()


@pytest.mark.parametrize("autocast", [True, False], ids=["bfloat16-autocast", "float32"])
def test_the_activations_per_layer_are_what_autograd_saves(autocast):
    """The plan's per-layer activations against a census of the tensors autograd keeps (two layers
    more, the same micro-batch): within 5%. An H200 gave the same census at real size."""
    (two, tokens), (four, _) = saved_activation_bytes(2, autocast), saved_activation_bytes(4, autocast)
    compute = torch.bfloat16 if autocast else torch.float32

    def activations(layers: int) -> int:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(
                Qwen2Config(
                    hidden_size=256,
                    intermediate_size=768,
                    num_hidden_layers=layers,
                    num_attention_heads=8,
                    num_key_value_heads=2,
                    vocab_size=512,
                )
            )
        chosen = settings(compute_dtype=compute, micro_batch_tokens=tokens, row_tokens=tokens // 2)
        return plan_memory(model, chosen, "cpu").terms(rank0=False)["activations"]

    planned = activations(4) - activations(2)
    assert planned == pytest.approx(four - two, rel=0.05)


def test_a_plan_over_the_device_is_refused_with_the_numbers_and_what_would_fit():
    plan = plan_memory(meta_model(), settings(), "cuda" if torch.cuda.is_available() else "cpu")
    checkpointed = dataclasses.replace(plan, settings=settings(activation_checkpointing=True))
    between = (checkpointed.total() + plan.total()) // 2
    tight = dataclasses.replace(plan, device_bytes=between)
    with pytest.raises(ConfigError) as error:
        tight.check()
    message = str(error.value)
    assert f"{plan.total() / GB:.1f} GB per rank" in message and "activations" in message
    assert "training.activation_checkpointing: true" in message
    dataclasses.replace(plan, device_bytes=plan.total()).check()  # exactly enough passes
    hopeless = dataclasses.replace(plan, device_bytes=1)
    with pytest.raises(ConfigError, match="no combination of these settings fits"):
        hopeless.check()
    # Where nothing alone is enough, the cheapest combination is named.
    with torch.device("meta"):
        big = Qwen2ForCausalLM(
            Qwen2Config(
                hidden_size=3584,
                num_hidden_layers=28,
                num_attention_heads=28,
                num_key_value_heads=4,
                intermediate_size=18944,
                vocab_size=152064,
            )
        )
    seven_b = MemoryPlan(ModelShape.of(big), settings(micro_batch_tokens=16384), "cuda", 80 * 10**9, 0)
    with pytest.raises(
        ConfigError,
        match="together these would: training.activation_checkpointing: true; "
        "inference on vLLM or a server; 4 processes",
    ):
        seven_b.check()
    with pytest.raises(
        ConfigError, match="alone would fit: .*training.micro_batch_tokens: 2048;"
    ):  # the largest that fits
        dataclasses.replace(plan, device_bytes=plan.total() - 1).check()


def test_the_plan_renders_one_column_per_kind_of_rank():
    one = plan_memory(meta_model(), settings(), "cpu").render()
    assert "rank 0" in one and "other ranks" not in one and "total" in one
    several = MemoryPlan(ModelShape.of(meta_model()), settings(world_size=2), "cpu", 10**12, 0).render()
    assert "other ranks" in several and "2 process(es)" in several


def test_a_colocated_engine_must_fit_beside_the_update_and_while_it_generates():
    engine = ColocatedEngine(gpu_share=0.5, cpu_kv_cache_bytes=2 * 10**9, sleeps=False)
    card = 10 * 10**9
    awake = MemoryPlan(
        ModelShape.of(meta_model()), settings(engine_tokens=None, colocated=engine), "cuda", card, 0
    )
    update, generation = awake.terms(rank0=True), awake.terms(rank0=True, phase="generation")
    assert update["vLLM colocated"] == generation["vLLM colocated"] == card // 2
    assert "activations" in update and "activations" not in generation and "gradients" not in generation
    assert "updating" in awake.render() and "generating" in awake.render()
    # Asleep during the update, the engine counts only while it generates.
    asleep = dataclasses.replace(
        awake, settings=settings(engine_tokens=None, colocated=dataclasses.replace(engine, sleeps=True))
    )
    assert "vLLM colocated" not in asleep.terms(rank0=True)
    assert asleep.total(phase="generation") == awake.total(phase="generation")
    # A card that holds the update only with the engine asleep: refused awake, naming the sleep level.
    # (the engine's share scales with the card: with the trainer's update U and generation G, a card
    # of U + G holds U alone, and G beside half of it, but not U beside half of it)
    generating = asleep.terms(rank0=True, phase="generation")
    tight = asleep.total() + sum(generating.values()) - generating["vLLM colocated"]
    with pytest.raises(ConfigError, match="inference.vllm.sleep_level: 2"):
        dataclasses.replace(awake, device_bytes=tight).check()
    dataclasses.replace(asleep, device_bytes=tight).check()
    # A share that leaves the trainer's weights no room fits in neither phase.
    greedy = dataclasses.replace(engine, gpu_share=1.0, sleeps=True)
    with pytest.raises(ConfigError):
        dataclasses.replace(asleep, settings=settings(engine_tokens=None, colocated=greedy)).check()
    # On the CPU build: a copy of the weights and the KV cache.
    cpu = MemoryPlan(
        ModelShape.of(meta_model()), settings(engine_tokens=None, colocated=engine), "cpu", card, 0
    )
    assert cpu.terms(rank0=True)["vLLM colocated"] == cpu.shape.parameters * 2 + 2 * 10**9
    # Under torchrun every process holds an engine of its own, rank 0's or not.
    sharded = MemoryPlan(
        ModelShape.of(meta_model()),
        settings(engine_tokens=None, colocated=engine, world_size=2),
        "cuda",
        card,
        0,
    )
    assert sharded.terms(rank0=False)["vLLM colocated"] == card // 2


def test_peak_memory_sees_a_large_allocation_and_starts_a_new_period():
    peak = PeakMemory("cpu")
    baseline = peak.take()
    block = torch.ones(64 * 2**20 // 4)  # 64 MB, touched
    del block
    assert peak.take() >= baseline + 0.05


def test_processes_on_one_machine_share_its_memory_on_cpu(monkeypatch):
    whole = device_memory("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert device_memory("cpu") == whole // 4


def test_a_distillation_teacher_is_counted_in_its_own_dtype(tiny_model_path):
    from llmrl.config import load_config
    from llmrl.models import load_model
    from llmrl.trainer.policy import plan_training_memory

    teacher = "distillation={teacher: 'tiny://arithmetic', teacher_dtype: bfloat16}"
    terms = plan_training_memory(load_config(None, [teacher]), "cpu", None).terms(rank0=True)
    model, _ = load_model("tiny://arithmetic", device="meta")
    assert terms["teacher"] == ModelShape.of(model).parameters * 2
    assert "teacher" not in plan_training_memory(load_config(None, []), "cpu", None).terms(rank0=True)
    missing = load_config(None, ["distillation={teacher: ./no-such-run}"])
    with pytest.raises(ConfigError, match="distillation.teacher: "):
        plan_training_memory(missing, "cpu", None)


def one_and_a_half_b() -> Qwen2ForCausalLM:
    """Qwen2.5-1.5B's body with the shipped tiny model's 1,024-token vocabulary, on the meta device."""
    with torch.device("meta"):
        return Qwen2ForCausalLM(
            Qwen2Config(
                hidden_size=1536,
                num_hidden_layers=28,
                num_attention_heads=12,
                num_key_value_heads=2,
                intermediate_size=8960,
                vocab_size=1024,
                tie_word_embeddings=True,
            )
        )


def test_on_a_gpu_the_engine_takes_what_the_plan_leaves_of_its_share():
    plan = MemoryPlan(
        ModelShape.of(one_and_a_half_b()), settings(activation_checkpointing=True), "cuda", 80 * 10**9, 0
    )
    sized = size_engine(plan, max_batch_tokens=None, max_concurrent=None, rows_in_flight=512, utilization=0.9)
    assert sized.engine_sizing is not None
    tokens = sized.settings.engine_tokens
    assert sized.engine_sizing.rows == 512
    assert 0.9 * 80e9 - sized.kv_bytes_per_token <= sized.total() <= 0.9 * 80e9  # filled to the share
    assert tokens > 100 * 8192 and sized.fits()  # tens of GB of KV cache, not the CPU's 8192 tokens
    assert sized.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2  # K and V, 28 layers, 2 KV heads of 128, bf16
    rendered = sized.render()
    assert f"embedded engine: 512 rows, {tokens} KV-cache tokens" in rendered
    assert "inference.max_batch_tokens and inference.max_concurrent sized from the GPU" in rendered
    # explicit settings win; rows are capped
    own_budget = size_engine(
        plan, max_batch_tokens=5000, max_concurrent=None, rows_in_flight=4096, utilization=0.9
    )
    assert own_budget.engine_sizing is not None and own_budget.engine_sizing.sized == ("max_concurrent",)
    assert (own_budget.engine_sizing.rows, own_budget.settings.engine_tokens) == (1024, 5000)
    assert (
        size_engine(plan, max_batch_tokens=5000, max_concurrent=7, rows_in_flight=1, utilization=0.9) is plan
    )
    # a card without room for the CPU default fails the check as an unsized plan would
    small = dataclasses.replace(plan, device_bytes=20 * 10**9)
    crowded = size_engine(
        small, max_batch_tokens=None, max_concurrent=None, rows_in_flight=8, utilization=0.9
    )
    assert crowded.settings.engine_tokens == 8192 and not crowded.fits()


def test_the_run_sizes_the_engine_on_cuda_only(tmp_path, monkeypatch):
    from llmrl.config import load_config

    step = ["training.prompts_per_step=4", "training.group_size=8", "training.generation_lag=1"]
    config = load_config(None, [f"run_dir={tmp_path}", *step])  # the demo: max_concurrent 256, no budget
    on_cpu = plan_training_memory(config, "cpu", None)
    assert on_cpu.engine_sizing is None and on_cpu.settings.engine_tokens == 8192

    def built(plan: MemoryPlan, config) -> tuple[int, int]:
        inference = Trainer._inference_config(
            dataclasses.make_dataclass("Run", ["memory_plan"])(plan), config
        )
        return inference.resolved_max_batch_tokens, inference.resolved_max_concurrent

    assert built(on_cpu, config) == (8192, 256)
    monkeypatch.setattr(memory_module, "device_memory", lambda device: 80 * 10**9)
    on_gpu = plan_training_memory(config, "cuda", None)
    assert on_gpu.engine_sizing is not None and on_gpu.engine_sizing.sized == ("max_batch_tokens",)
    assert (
        built(on_gpu, config) == (on_gpu.settings.engine_tokens, 256) and on_gpu.settings.engine_tokens > 8192
    )
    unset = load_config(None, [f"run_dir={tmp_path}", *step, "inference.max_concurrent=null"])
    assert built(plan_training_memory(unset, "cuda", None), unset)[1] == 4 * 8 * 2  # every sample in flight
    fixed = load_config(None, [f"run_dir={tmp_path}", "inference.max_batch_tokens=4096"])
    assert plan_training_memory(fixed, "cuda", None).engine_sizing is None


def test_on_a_gpu_lm_head_chunks_hold_up_to_one_layers_activations_in_logits():
    with torch.device("meta"):
        wide_vocabulary = Qwen2ForCausalLM(
            Qwen2Config(
                hidden_size=896,
                num_hidden_layers=24,
                num_attention_heads=14,
                num_key_value_heads=2,
                intermediate_size=4864,
                vocab_size=151936,
                tie_word_embeddings=True,
            )
        )  # Qwen2.5-0.5B
    shape = ModelShape.of(wide_vocabulary)
    chosen = settings(micro_batch_tokens=16384)
    cpu = MemoryPlan(shape, chosen, "cpu", 10**12, 0)
    gpu = MemoryPlan(shape, chosen, "cuda", 80 * 10**9, 0)
    assert cpu.logits_chunk_tokens is None  # the CPU's chunks (and numbers) stay as they were
    fixed = memory_module.CHUNK_ELEMENTS // shape.vocab  # 110 tokens
    chunk = gpu.logits_chunk_tokens
    assert fixed * 5 < chunk < 16384
    head_growth = gpu.terms(rank0=True)["activations"] - cpu.terms(rank0=True)["activations"]
    assert head_growth == memory_module.HEAD_BYTES_PER_LOGIT * (chunk - fixed) * shape.vocab - 12 * (
        memory_module.CHUNK_ELEMENTS - fixed * shape.vocab
    )
    assert head_growth <= gpu._layer_activations()  # the plan grows by at most a layer's activations
    # A small vocabulary: a whole micro-batch is one chunk.
    assert (
        MemoryPlan(ModelShape.of(meta_model()), settings(), "cuda", 80 * 10**9, 0).logits_chunk_tokens == 4096
    )
