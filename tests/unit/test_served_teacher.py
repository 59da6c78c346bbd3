"""A served distillation teacher (`distillation.teacher_server`): llmrl's server in process (ASGI transport)
gives the scores and the update the loaded teacher gives; a server that is down, refuses or answers
with what cannot be used stops the run in one line; the memory plan counts no teacher."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch

from llmrl.algorithms.logprobs import token_top_k
from llmrl.algorithms.packing import build_batch, unpack
from llmrl.config import AlgorithmConfig, ConfigError, DistillationConfig, TrainingConfig, load_config
from llmrl.inference.decoder import HFDecoder, LlamaFamilyDecoder
from llmrl.inference.engine import LocalEngine
from llmrl.inference.interface import InferenceUnavailableError
from llmrl.inference.served_teacher import ServedTeacher, TeacherServerError
from llmrl.rollouts import prepare_batch
from llmrl.server.inference_server import create_inference_app
from llmrl.trainer.optimization import PolicyUpdate
from llmrl.trainer.policy import plan_training_memory
from llmrl.types import GenerationArgs, RolloutGroup
from tests.unit.test_trainer_parts import VOCAB, assert_same_weights, random_groups, tiny_policy


@pytest.fixture
def teacher(tiny_model):
    """(the teacher model, a `ServedTeacher` of a copy of it behind llmrl's server in process)."""
    _, tokenizer = tiny_model  # its first VOCAB ids name the pieces of the prompt logprobs
    model = tiny_policy(1).eval()
    engine = LocalEngine(copy.deepcopy(model), tokenizer, owns_model=True)
    transport = httpx.ASGITransport(create_inference_app(engine, model_name="teacher"))
    return model, ServedTeacher("http://teacher", transport=transport, max_concurrent=4)


def test_both_decoders_score_every_position_of_a_prompt_as_the_model_does():
    model = tiny_policy(1).eval()
    prompt = [3, 17, 5, 40, 9, 2]
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
        for decoder in (HFDecoder(model), LlamaFamilyDecoder(copy.deepcopy(model), owns_model=True)):
            torch.testing.assert_close(decoder.prompt_logits(prompt), expected, atol=1e-5, rtol=0)
            assert decoder.num_rows == 0  # nothing cached


def sequences_and_masks(groups: list[RolloutGroup]) -> tuple[list[list[int]], list[list[bool]]]:
    rollouts = [r for g in groups for r in g.rollouts]
    return [r.tokens for r in rollouts], [r.mask for r in rollouts]


@pytest.mark.parametrize("top_k", [6, 1000], ids=["top_6", "whole_vocabulary"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_served_top_k_is_the_loaded_teachers(teacher, top_k, temperature):
    model, served = teacher
    sequences, masks = sequences_and_masks(random_groups(3, 4))
    got = served.score(sequences, masks, [temperature] * len(sequences), top_k)
    packed = build_batch(sequences, [[i] for i in range(len(sequences))], masks)
    with torch.no_grad():
        expected = [unpack(output, packed) for output in token_top_k(model, packed, temperature, top_k)]
    assert got[0][1].shape[-1] == min(top_k, VOCAB) + 1
    for i, (logprobs, grouped, ids) in enumerate(got):
        want_logprobs, want_grouped, want_ids = (output[i] for output in expected)
        torch.testing.assert_close(logprobs, want_logprobs, atol=1e-5, rtol=0)
        mask = torch.tensor(masks[i])
        # The same k tokens (in an order that may differ where logprobs tie), and the same rest.
        assert torch.equal(ids[mask].sort(-1).values, want_ids[mask].sort(-1).values)
        torch.testing.assert_close(
            grouped[mask, :-1].sort(-1).values, want_grouped[mask, :-1].sort(-1).values
        )
        torch.testing.assert_close(grouped[:, -1], want_grouped[:, -1], atol=1e-4, rtol=0)


def test_a_one_token_sequence_has_nothing_to_score(teacher):
    _, served = teacher
    logprobs, grouped, ids = served.score([[5]], [[False]], [1.0], 4)[0]
    assert logprobs.tolist() == [0.0] and grouped.shape == (1, 5) and ids.shape == (1, 4)


def update_with(groups, distillation, **teacher):
    """One `PolicyUpdate` step of a fresh `tiny_policy(0)` with `teacher=` or `teacher_server=`."""
    policy = tiny_policy(0)
    update = PolicyUpdate(
        policy,
        torch.optim.SGD(policy.parameters(), lr=0.5),
        algorithm=AlgorithmConfig(),
        training=TrainingConfig(lr=0.5),
        generation_args=GenerationArgs(),
        max_tokens=8,
        pad_token_id=0,
        distillation=distillation,
        **teacher,
    )
    batch, _ = prepare_batch(groups, group_size=4, algorithm=AlgorithmConfig(), max_tokens=8)
    return policy, update(batch, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("signal", ["top_k", "sampled"])
def test_a_served_teacher_trains_as_the_loaded_one(teacher, signal):
    model, served = teacher
    groups = random_groups(2, 4)
    distillation = DistillationConfig(teacher="t", coef=0.3, top_k=6, signal=signal)
    loaded_policy, loaded = update_with(groups, distillation, teacher=model)
    served_config = DistillationConfig(
        teacher_server={"url": "http://teacher"}, coef=0.3, top_k=6, signal=signal
    )
    served_policy, metrics = update_with(groups, served_config, teacher_server=served)
    assert metrics.keys() == loaded.keys()
    for key, value in loaded.items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert_same_weights(served_policy, loaded_policy, atol=1e-5)


def scripted(answer, status: int = 200) -> ServedTeacher:
    """A `ServedTeacher` of a server that gives every request `answer` (or raises it)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(status, json=answer)

    return ServedTeacher(
        "http://teacher/v1", model="t", transport=httpx.MockTransport(handle), max_retries=1, backoff_s=0
    )


SEQUENCE, MASK = [3, 4, 5], [False, True, True]


def test_a_teacher_server_that_is_down_stops_the_run_in_one_line():
    served = scripted(httpx.ConnectError("refused"))
    with pytest.raises(
        InferenceUnavailableError, match=r"^distillation teacher server at http://teacher/v1 not an"
    ) as e:
        served.score([SEQUENCE], [MASK], [1.0], 4)
    assert "\n" not in str(e.value) and "rerun the same command to resume" in str(e.value)


@pytest.mark.parametrize(
    ("answer", "field"),
    [
        (
            {"choices": [{"text": ""}]},
            r"choices\[0\]\.prompt_logprobs: .* has none entries for a prompt of 3",
        ),
        (
            {"choices": [{"prompt_logprobs": [None, {"4": {"rank": 1}}, {"5": {"logprob": -1.0}}]}]},
            r"choices\[0\]\.prompt_logprobs\[1\]: .* without a numeric `logprob`",
        ),
        (
            {"choices": [{"prompt_logprobs": [None, {"9": {"logprob": -1.0}}, {"5": {"logprob": -1.0}}]}]},
            r"choices\[0\]\.prompt_logprobs\[1\]: .* lacks the prompt's token 4",
        ),
        ("nonsense", r"prompt_logprobs_temperature|choices"),
    ],
    ids=["no_prompt_logprobs", "no_logprob", "no_token", "not_an_object"],
)
def test_a_malformed_answer_names_its_field(answer, field):
    with pytest.raises(TeacherServerError, match=field) as e:
        scripted(answer).score([SEQUENCE], [MASK], [1.0], 4)
    assert "\n" not in str(e.value)


def test_a_refused_request_and_a_temperature_the_server_does_not_score_at_are_one_line():
    with pytest.raises(
        TeacherServerError, match=r"^distillation.teacher_server: .* HTTP 400: too many logprobs$"
    ):
        scripted({"message": "too many logprobs"}, status=400).score([SEQUENCE], [MASK], [1.0], 4)
    vllm_like = {"choices": [{"prompt_logprobs": [None, {"4": {"logprob": -1.0}}, {"5": {"logprob": -2.0}}]}]}
    with pytest.raises(TeacherServerError, match=r"^prompt_logprobs_temperature: .* sampled at 0.7; "):
        scripted(vllm_like).score([SEQUENCE], [MASK], [0.7], 4)
    (logprobs,) = scripted(vllm_like).score([SEQUENCE], [MASK], [1.0], None)[0]
    assert logprobs.tolist() == [0.0, -1.0, -2.0]


def test_a_served_teacher_refuses_filtered_sampling(teacher):
    _, served = teacher
    groups = random_groups(1, 4)
    filtered = [
        r.model_copy(update={"generation_args": GenerationArgs(top_p=0.9)}) for r in groups[0].rollouts
    ]
    config = DistillationConfig(teacher_server={"url": "http://teacher"}, signal="sampled")
    with pytest.raises(ConfigError, match=r"^distillation.teacher_server: env problem .* top_p"):
        update_with([RolloutGroup(group_id="g", rollouts=filtered)], config, teacher_server=served)


def test_one_teacher_is_named_and_a_served_one_takes_no_memory(tiny_model_path):
    for wrong in ("{}", "{teacher: tiny://arithmetic, teacher_server: {url: 'http://t'}}"):
        with pytest.raises(ConfigError, match="name one teacher"):
            load_config(None, [f"distillation={wrong}"])
    with pytest.raises(ConfigError, match="teacher_dtype: a served teacher runs in its server's dtype"):
        load_config(None, ["distillation={teacher_server: {url: 'http://t'}, teacher_dtype: float32}"])
    served = load_config(None, ["distillation={teacher_server: {url: 'http://t', model: teacher}}"])
    assert served.distillation.teacher_server.model == "teacher"
    assert "teacher" not in plan_training_memory(served, "cpu", None).terms(rank0=True)
