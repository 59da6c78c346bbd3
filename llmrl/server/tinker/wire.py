"""The Tinker API's wire formats: the SDK's protobuf ``forward_backward`` request checked field by field,
its protobuf answers, and its sampling parameters as llmrl's. Anything malformed is `Refused` with a
one-line message naming the field."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError
from pydantic import BaseModel, ValidationError
from tinker import types
from tinker.proto import tinker_public_pb2 as proto

from llmrl.server.tinker.losses import LossCall
from llmrl.types import GenerationArgs, validation_problems

PROTOBUF = "application/x-protobuf"


class Refused(Exception):
    """A request answered with `status` and a one-line `message` (4xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Datum:
    """One ``forward_backward`` datum: input tokens, the token each position predicts, and the loss's
    other per-token inputs by their Tinker names (``weights``, ``logprobs``, ``advantages``)."""

    tokens: list[int]
    targets: list[int]
    inputs: dict[str, torch.Tensor]


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A checked ``forward_backward`` request: whose model, which loss with which settings, the data."""

    model_id: str
    loss: LossCall
    data: list[Datum]
    forward_only: bool


def forward_backward_output(logprobs: list[np.ndarray], loss: float) -> bytes:
    """The SDK's protobuf ``ForwardBackwardOutput``: one ``logprobs`` array per datum, batched."""
    sizes = [array.astype(np.float32).nbytes for array in logprobs]
    offsets = np.cumsum([0, *sizes], dtype=np.int64)
    batched = proto.BatchedTensor(
        data=b"".join(array.astype(np.float32).tobytes() for array in logprobs),
        offsets=offsets.tobytes(),
        dtype=proto.DTYPE_FLOAT32,
    )
    record = proto.ArrayRecord(type_tag="ArrayRecord", fields={"logprobs": batched}, num_datums=len(logprobs))
    output = proto.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics={"loss:sum": loss}
    )
    return output.SerializeToString()


def parse_forward_backward(
    body: bytes, model_limits: Callable[[str], tuple[int, int]]
) -> ForwardBackwardCall:
    """The SDK's protobuf ``ForwardBackwardRequest``, checked field by field; `model_limits` gives a
    model id's vocabulary size and positions (and refuses an unknown id)."""
    message = proto.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError:
        raise Refused(400, "body: not a tinker ForwardBackwardRequest protobuf") from None
    vocab_size, positions = model_limits(message.model_id)
    loss = loss_call(message.loss_fn, _loss_config(message))
    if not message.data:
        raise Refused(400, "data: no datum")
    data = [_datum(datum, f"data[{i}]", loss, vocab_size, positions) for i, datum in enumerate(message.data)]
    return ForwardBackwardCall(message.model_id, loss, data, message.forward_only)


def loss_call(name: str, config: dict[str, float | str]) -> LossCall:
    """The loss `name` with `config`, or the one line saying why not."""
    try:
        return LossCall.of(name, config)
    except ValueError as exc:
        raise Refused(400, str(exc)) from None


def _loss_config(message: Any) -> dict[str, float | str]:
    """``loss_fn_config``: the SDK sends numbers in both of its maps and strings in the second only."""
    if not message.loss_fn_config_v2:
        return dict(message.loss_fn_config)
    return {
        key: value.text if value.WhichOneof("value") == "text" else value.number
        for key, value in message.loss_fn_config_v2.items()
    }


def _datum(message: Any, where: str, loss: LossCall, vocab_size: int, positions: int) -> Datum:
    tokens: list[int] = []
    for j, chunk in enumerate(message.model_input):
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise Refused(400, f"{where}.model_input.chunks[{j}]: only encoded_text chunks are served")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    if not tokens:
        raise Refused(400, f"{where}.model_input: no tokens")
    if len(tokens) >= positions:  # the sequence is the inputs and the last target
        raise Refused(
            400, f"{where}.model_input: {len(tokens)} tokens; the model takes at most {positions - 1} here"
        )
    given = dict(message.loss_fn_inputs)
    accepted = ("target_tokens", *loss.spec.inputs, *loss.spec.optional_inputs)
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise Refused(400, f"{where}.loss_fn_inputs.{unknown[0]}: {loss.name} takes {', '.join(accepted)}")
    for name in ("target_tokens", *loss.spec.inputs):
        if name not in given:
            raise Refused(400, f"{where}.loss_fn_inputs.{name}: required by {loss.name}")
    arrays = {
        name: _tensor(
            value, f"{where}.loss_fn_inputs.{name}", np.int64 if name == "target_tokens" else np.float32
        )
        for name, value in given.items()
    }
    for name, values in arrays.items():
        if values.shape != (len(tokens),):
            raise Refused(
                400,
                f"{where}.loss_fn_inputs.{name}: shape {list(values.shape)} for {len(tokens)} input tokens "
                f"(one per input token)",
            )
    targets = arrays.pop("target_tokens")
    for name, values in (("model_input", np.asarray(tokens)), ("loss_fn_inputs.target_tokens", targets)):
        outside = values[(values < 0) | (values >= vocab_size)]
        if outside.size:
            raise Refused(
                400,
                f"{where}.{name}: token {int(outside[0])} is outside the vocabulary (0..{vocab_size - 1})",
            )
    for name, values in arrays.items():
        if not np.isfinite(values).all():
            raise Refused(400, f"{where}.loss_fn_inputs.{name}: must be finite")
    if loss.name != "cross_entropy" and "weights" in arrays and not np.isin(arrays["weights"], (0, 1)).all():
        raise Refused(
            400,
            f"{where}.loss_fn_inputs.weights: {loss.name} takes weights as a 0/1 mask of the tokens it sees",
        )
    if tokens[1:] != targets[:-1].tolist():
        raise Refused(
            400,
            f"{where}.loss_fn_inputs.target_tokens: must be model_input shifted by one "
            "(targets[i] == tokens[i + 1]); other targets are not served yet",
        )
    inputs = {name: torch.from_numpy(values.copy()) for name, values in arrays.items()}
    return Datum(tokens, targets.tolist(), inputs)


def _tensor(message: Any, where: str, dtype: type) -> np.ndarray:
    if message.HasField("sparse_csr"):
        raise Refused(400, f"{where}: sparse tensors are not served yet (send it dense)")
    kinds = {proto.DTYPE_FLOAT32: np.float32, proto.DTYPE_INT64: np.int64}
    if message.dtype not in kinds:
        raise Refused(400, f"{where}: dtype must be float32 or int64")
    values = np.frombuffer(message.dense, dtype=kinds[message.dtype])
    shape = list(message.shape) or [values.size]
    if int(np.prod(shape)) != values.size:
        raise Refused(400, f"{where}: {values.size} values for shape {shape}")
    return values.reshape(shape).astype(dtype)


def generation_args(params: types.SamplingParams) -> GenerationArgs:
    """Tinker's sampling parameters as llmrl's; ``stop=[]`` turns eos off, as Tinker defines it."""
    if params.max_tokens is None:
        raise Refused(400, "sampling_params.max_tokens: required")
    stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    strings = [s for s in stop if isinstance(s, str)]
    token_ids = [s for s in stop if not isinstance(s, str)]
    if strings and token_ids:
        raise Refused(400, "sampling_params.stop: strings or token ids, not both")
    try:
        return GenerationArgs(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=max(params.top_k, 0),
            max_tokens=params.max_tokens,
            stop=tuple(strings),
            stop_token_ids=tuple(token_ids),
            ignore_eos=params.stop is not None and not stop,
            seed=params.seed,
        )
    except ValidationError as exc:
        raise Refused(400, "sampling_params." + validation_problems(exc.errors())) from None


def sample_response(responses: list[Any], prompt_logprobs: np.ndarray | None = None) -> bytes:
    """The SDK's protobuf ``SampleResponse``: each sample's tokens, logprobs and why it stopped, and the
    prompt's logprobs where they were asked for."""
    sequences = [
        proto.SampledSequence(
            stop_reason=proto.STOP_REASON_LENGTH
            if response.finish_reason == "length"
            else proto.STOP_REASON_STOP,
            tokens=np.asarray(response.token_ids, dtype=np.int32).tobytes(),
            logprobs=None
            if response.logprobs is None
            else np.asarray(response.logprobs, dtype=np.float32).tobytes(),
        )
        for response in responses
    ]
    scored = None if prompt_logprobs is None else prompt_logprobs.astype(np.float32).tobytes()
    return proto.SampleResponse(sequences=sequences, prompt_logprobs=scored).SerializeToString()


def prompt_logprobs(token_logprobs: torch.Tensor, last_n: int | None) -> np.ndarray:
    """Each prompt token's logprob as the SDK reads them: NaN (None to the caller) for the first token,
    which nothing predicts, and before the last `last_n` where only those were asked for."""
    values = np.concatenate([[np.nan], token_logprobs.numpy()])
    if last_n is not None:
        values[: len(values) - last_n] = np.nan
    return values


class WeightsInfoRequest(BaseModel):
    """``RestClient.get_weights_info_by_tinker_path``'s body (the SDK sends it without a type of its own)."""

    tinker_path: str


def validated(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise Refused(422, validation_problems(exc.errors()) or "body: invalid") from None
