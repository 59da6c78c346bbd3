"""A server the official ``tinker`` SDK drives: a user's own loop calls ``forward_backward``, ``optim_step``
and ``sample`` on LoRA adapters that llmrl trains and samples (docs/tinker.md).

The SDK's own types (`tinker.types`, pydantic models) are the contract: JSON bodies are validated with
them and answers are built from them; ``forward_backward`` arrives as the SDK's protobuf, and its
result and samples go back as protobuf, as the SDK reads them. Each call that does work answers at
once with a future (``request_id``) that the SDK polls on ``/api/v1/retrieve_future``: the model work
runs on one worker thread in the order the calls arrived, which is the order of each training
client's ``seq_id`` (the SDK sends a client's next call only once the previous one was accepted).
Sampling runs on the embedded engine (`LocalEngine`), one per saved snapshot, serving the base with
the adapter merged in.

Errors: a malformed request gets a 4xx naming the field; a call this server does not serve yet gets a
404 naming the SDK call. The SDK retries 5xx answers for minutes, so nothing the caller can fix is a
5xx.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from google.protobuf.message import DecodeError
from pydantic import BaseModel, ValidationError
from tinker import types
from tinker.proto import tinker_public_pb2 as proto

from llmrl.algorithms.logprobs import token_logprobs
from llmrl.algorithms.packing import build_batch, pack, unpack
from llmrl.inference.engine import LocalEngine
from llmrl.inference.kv_cache import max_positions
from llmrl.server.common import DEFAULT_HOST, error_response, run_server, secure_app
from llmrl.types import GenerationArgs, InferenceRequest, validation_problems

log = logging.getLogger(__name__)

MIB = 1024**2
PROTOBUF = "application/x-protobuf"
RETRIEVE_WAIT_S = 20.0
"""How long ``retrieve_future`` holds a poll open before answering ``try_again`` (the SDK waits 45 s)."""
PACKED_ROW_TOKENS = 4096
"""Tokens per packed row of a ``forward_backward`` batch (a longer datum gets a row of its own)."""
SERVED_LOSSES = ("cross_entropy",)

# The SDK's calls this server does not do yet, by route, so that the refusal names the call.
NOT_SERVED_YET = {
    "/api/v1/save_weights": "TrainingClient.save_state",
    "/api/v1/load_weights": "TrainingClient.load_state / ServiceClient.create_training_client_from_state",
    "/api/v1/save_weights_external": "TrainingClient.save_weights_external",
    "/api/v1/create_sampling_session": "ServiceClient.create_sampling_client (a saved path or a base model)",
    "/api/v1/join_sampling_session": "an unpickled SamplingClient",
    "/api/v1/retrieve_futures": "the session futures poller",
    "/api/v1/create_custom_loss": "ServiceClient.create_custom_loss",
    "/api/v1/copy_weights": "RestClient.copy_weights",
    "/api/v1/unload_model": "TrainingClient.unload_model",
    "/api/v1/cancel_future": "cancelling a sample",
    "/api/v1/auth/token": "JWT authentication",
}

# Tinker's LoRA switches, as the module names of the Llama/Qwen2 families llmrl serves.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
LORA_ALPHA = 32.0


class Refused(Exception):
    """A request answered with `status` and a one-line `message` (4xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class TrainedModel:
    """One training client: a LoRA adapter over its own copy of a base model, and its AdamW."""

    model_id: str
    base_model: str
    rank: int
    peft_model: Any
    tokenizer: Any
    optimizer: torch.optim.AdamW

    @property
    def config(self) -> Any:
        return self.peft_model.get_base_model().config


@dataclass
class Sampler:
    """A sampling session: an engine serving a snapshot of an adapter merged into its base."""

    base_model: str
    engine: LocalEngine


@dataclass(frozen=True)
class Datum:
    """One ``forward_backward`` datum: input tokens, the token each position predicts, its weight."""

    tokens: list[int]
    targets: list[int]
    weights: torch.Tensor


@dataclass
class TinkerService:
    """The server's state: the base models it may train, sessions, trained models, samplers, futures."""

    base_specs: list[str]
    lora_rank_max: int
    device: str
    seed: int = 0
    sessions: set[str] = field(default_factory=set)
    models: dict[str, TrainedModel] = field(default_factory=dict)
    samplers: dict[str, Sampler] = field(default_factory=dict)
    futures: dict[str, asyncio.Future] = field(default_factory=dict)
    _bases: dict[str, tuple[torch.nn.Module, Any]] = field(default_factory=dict)
    _worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmrl-tinker")
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- futures ---------------------------------------------------------------------------------

    def submit(self, work: Callable[[], Any], model_id: str | None = None) -> dict[str, Any]:
        """Queue `work` on the worker (model work runs one call at a time, in arrival order)."""
        request_id = uuid.uuid4().hex
        self.futures[request_id] = asyncio.get_running_loop().run_in_executor(self._worker, work)
        return types.UntypedAPIFuture(request_id=request_id, model_id=model_id).model_dump(exclude_none=True)

    async def retrieve(self, request_id: str) -> Response:
        future = self.futures.get(request_id)
        if future is None:
            raise Refused(404, f"request_id: no future {request_id!r} on this server")
        try:
            result = await asyncio.wait_for(asyncio.shield(future), RETRIEVE_WAIT_S)
        except TimeoutError:
            pending = types.TryAgainResponse(request_id=request_id, queue_state="active")
            return JSONResponse(pending.model_dump(mode="json"))
        except Refused as exc:
            failed = types.RequestFailedResponse(error=exc.message, category=types.RequestErrorCategory.User)
            return JSONResponse(failed.model_dump(mode="json"))
        except Exception as exc:
            log.exception("request %s failed", request_id)
            failed = types.RequestFailedResponse(
                error=f"{type(exc).__name__}: {exc}", category=types.RequestErrorCategory.Server
            )
            return JSONResponse(failed.model_dump(mode="json"))
        if isinstance(result, bytes):
            return Response(result, media_type=PROTOBUF)
        return JSONResponse(result.model_dump(mode="json", exclude_none=True))

    # -- models ----------------------------------------------------------------------------------

    def capabilities(self) -> types.GetServerCapabilitiesResponse:
        return types.GetServerCapabilitiesResponse(
            supported_models=[
                types.SupportedModel(model_name=spec, trainable=True, sampleable=True)
                for spec in self.base_specs
            ]
        )

    def check_new_model(self, request: types.CreateModelRequest) -> None:
        """Refuse what `create_model` cannot do before a future is made for it."""
        self.check_session(request.session_id)
        if request.base_model not in self.base_specs:
            raise Refused(
                400, f"base_model: {request.base_model!r} is not served here (served: {self.base_specs})"
            )
        lora = request.lora_config
        if lora is None:
            raise Refused(400, "lora_config: required (full fine-tuning is not served)")
        if not 1 <= lora.rank <= self.lora_rank_max:
            raise Refused(400, f"lora_config.rank: must be in 1..{self.lora_rank_max}, got {lora.rank}")
        if not isinstance(request.optimizer_config, types.AdamOptimizerConfig):
            raise Refused(
                400, f"optimizer_config: only adamw is served, got {request.optimizer_config.type!r}"
            )

    def create_model(self, request: types.CreateModelRequest) -> types.CreateModelResponse:
        import peft

        lora = request.lora_config
        assert lora is not None
        base, tokenizer = self.load_base(request.base_model)
        model = copy.deepcopy(base)
        targets = [
            *(ATTENTION_MODULES if lora.train_attn else ()),
            *(MLP_MODULES if lora.train_mlp else ()),
            *(UNEMBED_MODULES if lora.train_unembed else ()),
        ]
        if lora.train_unembed and model.config.tie_word_embeddings:
            # The head's adapter must not reach the input embedding when it is merged for sampling.
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
            model.config.tie_word_embeddings = False
        config = peft.LoraConfig(
            r=lora.rank, lora_alpha=LORA_ALPHA, target_modules=targets, task_type="CAUSAL_LM"
        )
        # peft draws A from torch's global generator: the seed makes the adapter reproducible.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed if lora.seed is None else lora.seed)
            peft_model = peft.get_peft_model(model, config)
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        for parameter in trainable:
            parameter.data = parameter.data.float()
        model_id = f"{request.session_id}:train:{request.model_seq_id}"
        optimizer = torch.optim.AdamW(trainable, lr=types.AdamParams().learning_rate)
        with self._lock:
            self.models[model_id] = TrainedModel(
                model_id, request.base_model, lora.rank, peft_model, tokenizer, optimizer
            )
        return types.CreateModelResponse(model_id=model_id)

    def load_base(self, spec: str) -> tuple[torch.nn.Module, Any]:
        """The base model of `spec`, loaded once; each trained model deep-copies it."""
        if spec not in self._bases:
            from llmrl.models import load_model

            model, tokenizer = load_model(spec, device=self.device)
            for parameter in model.parameters():
                parameter.requires_grad_(False)
            self._bases[spec] = (model, tokenizer)
        return self._bases[spec]

    def model(self, model_id: str) -> TrainedModel:
        trained = self.models.get(model_id)
        if trained is None:
            raise Refused(404, f"model_id: no training client {model_id!r} on this server")
        return trained

    def info(self, model_id: str) -> types.GetInfoResponse:
        trained = self.model(model_id)
        return types.GetInfoResponse(
            model_id=model_id,
            model_data=types.ModelData(model_name=trained.base_model),
            is_lora=True,
            lora_rank=trained.rank,
            model_name=trained.base_model,
        )

    def check_session(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise Refused(404, f"session_id: no session {session_id!r} on this server")

    # -- training --------------------------------------------------------------------------------

    def forward_backward(self, trained: TrainedModel, data: list[Datum], forward_only: bool) -> bytes:
        """Tinker's ``cross_entropy``: loss = -sum over data and tokens of weight * logprob(target);
        the gradient adds to what earlier calls left until `optim_step`. Answers the SDK's protobuf
        ``ForwardBackwardOutput`` with each datum's target logprobs and the ``loss:sum`` metric."""
        # Targets are the inputs shifted by one, so datum i is the sequence tokens + [last target]:
        # llmrl's packed logprobs of its tokens 1.. are the targets' logprobs.
        sequences = [datum.tokens + datum.targets[-1:] for datum in data]
        lengths = [len(sequence) for sequence in sequences]
        bins = pack(lengths, max_tokens=max(PACKED_ROW_TOKENS, *lengths))
        batch = build_batch(sequences, bins, pad_token_id=trained.tokenizer.pad_token_id or 0).to(self.device)
        model = trained.peft_model.get_base_model()
        with torch.set_grad_enabled(not forward_only):
            logprobs, _ = token_logprobs(model, batch)
            per_datum = unpack(logprobs, batch)
            target_logprobs = [per_datum[i][1:] for i in range(len(data))]
            loss = -sum(
                (datum.weights.to(self.device) * values).sum()
                for datum, values in zip(data, target_logprobs, strict=True)
            )
            assert isinstance(loss, torch.Tensor)
            if not forward_only:
                loss.backward()
        return _forward_backward_output(
            [values.detach().float().cpu().numpy() for values in target_logprobs], float(loss.detach())
        )

    def optim_step(self, trained: TrainedModel, params: types.AdamParams) -> types.OptimStepResponse:
        """One AdamW step with this call's hyperparameters (Tinker's: decoupled weight decay, optional
        clipping of the global gradient norm); the gradients are then cleared."""
        trainable = [p for group in trained.optimizer.param_groups for p in group["params"]]
        metrics: dict[str, float] = {}
        if params.grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(trainable, params.grad_clip_norm)
            metrics["grad_norm:mean"] = float(norm)
        for group in trained.optimizer.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        trained.optimizer.step()
        trained.optimizer.zero_grad(set_to_none=True)
        return types.OptimStepResponse(metrics=metrics)

    # -- sampling --------------------------------------------------------------------------------

    def save_for_sampler(
        self, trained: TrainedModel, request: types.SaveWeightsForSamplerRequest
    ) -> types.SaveWeightsForSamplerResponseInternal:
        """A snapshot of the adapter merged into a copy of its base, served by an engine of its own."""
        merged = copy.deepcopy(trained.peft_model).merge_and_unload()
        engine = LocalEngine(merged, trained.tokenizer, seed=self.seed, owns_model=True)
        session_id = trained.model_id.split(":train:")[0]
        sampler_id = f"{session_id}:sample:{request.sampling_session_seq_id}"
        with self._lock:
            self.samplers[sampler_id] = Sampler(trained.base_model, engine)
        return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id)

    def sampler(self, sampler_id: str | None) -> Sampler:
        sampler = self.samplers.get(sampler_id or "")
        if sampler is None:
            raise Refused(404, f"sampling_session_id: no sampler {sampler_id!r} on this server")
        return sampler

    def finish_session(self, session_id: str) -> None:
        """The session's models and samplers are released: its client closed it."""
        self.sessions.discard(session_id)
        prefix = f"{session_id}:"
        with self._lock:
            for model_id in [m for m in self.models if m.startswith(prefix)]:
                del self.models[model_id]
            finished = [s for s in self.samplers if s.startswith(prefix)]
            engines = [self.samplers.pop(sampler_id).engine for sampler_id in finished]
        for engine in engines:
            engine.close()

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        for sampler in self.samplers.values():
            sampler.engine.close()


def _forward_backward_output(logprobs: list[np.ndarray], loss: float) -> bytes:
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


def parse_forward_backward(body: bytes, service: TinkerService) -> tuple[TrainedModel, list[Datum], bool]:
    """The SDK's protobuf ``ForwardBackwardRequest``, checked field by field."""
    message = proto.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError:
        raise Refused(400, "body: not a tinker ForwardBackwardRequest protobuf") from None
    trained = service.model(message.model_id)
    if message.loss_fn not in SERVED_LOSSES:
        raise Refused(
            400, f"loss_fn: {message.loss_fn!r} is not served yet (served: {', '.join(SERVED_LOSSES)})"
        )
    if message.loss_fn_config or message.loss_fn_config_v2:
        raise Refused(400, f"loss_fn_config: {message.loss_fn} takes none")
    if not message.data:
        raise Refused(400, "data: no datum")
    vocab_size, positions = int(trained.config.vocab_size), max_positions(trained.config)
    data = [_datum(datum, f"data[{i}]", vocab_size, positions) for i, datum in enumerate(message.data)]
    return trained, data, message.forward_only


def _datum(message: Any, where: str, vocab_size: int, positions: int) -> Datum:
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
    inputs = dict(message.loss_fn_inputs)
    unknown = sorted(set(inputs) - {"target_tokens", "weights"})
    if unknown:
        raise Refused(
            400, f"{where}.loss_fn_inputs.{unknown[0]}: cross_entropy takes target_tokens and weights"
        )
    for name in ("target_tokens", "weights"):
        if name not in inputs:
            raise Refused(400, f"{where}.loss_fn_inputs.{name}: required by cross_entropy")
    targets = _tensor(inputs["target_tokens"], f"{where}.loss_fn_inputs.target_tokens", np.int64)
    weights = _tensor(inputs["weights"], f"{where}.loss_fn_inputs.weights", np.float32)
    for name, values in (("target_tokens", targets), ("weights", weights)):
        if values.shape != (len(tokens),):
            raise Refused(
                400,
                f"{where}.loss_fn_inputs.{name}: shape {list(values.shape)} for {len(tokens)} input tokens "
                f"(one per input token)",
            )
    for name, values in (("model_input", np.asarray(tokens)), ("loss_fn_inputs.target_tokens", targets)):
        outside = values[(values < 0) | (values >= vocab_size)]
        if outside.size:
            raise Refused(
                400,
                f"{where}.{name}: token {int(outside[0])} is outside the vocabulary (0..{vocab_size - 1})",
            )
    if not np.isfinite(weights).all():
        raise Refused(400, f"{where}.loss_fn_inputs.weights: must be finite")
    if tokens[1:] != targets[:-1].tolist():
        raise Refused(
            400,
            f"{where}.loss_fn_inputs.target_tokens: must be model_input shifted by one "
            "(targets[i] == tokens[i + 1]); other targets are not served yet",
        )
    return Datum(tokens, targets.tolist(), torch.from_numpy(weights.copy()))


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


def sample_response(responses: list[Any]) -> bytes:
    """The SDK's protobuf ``SampleResponse``: each sample's tokens, logprobs and why it stopped."""
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
    return proto.SampleResponse(sequences=sequences).SerializeToString()


def _validated(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise Refused(422, validation_problems(exc.errors()) or "body: invalid") from None


def create_tinker_app(service: TinkerService, *, max_body_bytes: int = 256 * MIB) -> FastAPI:
    """The routes the SDK calls (module docstring); anything else it may call is refused by name."""
    app = secure_app(FastAPI(title="llmrl tinker"), api_key=None, max_body_bytes=max_body_bytes)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Refused)
        return error_response(exc.status, exc.message)

    @app.get("/healthz")
    @app.get("/api/v1/healthz")
    async def health() -> dict:
        return types.HealthResponse(status="ok").model_dump()

    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> dict:
        _validated(types.ClientConfigRequest, await request.body())
        # Plain httpx transport: nothing here needs the SDK's reqwest one.
        return types.ClientConfigResponse(use_pyqwest_transport=False).model_dump()

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config(request: Request) -> dict:
        _validated(types.ClientConfigRequest, await request.body())
        return types.ClientDynamicConfigResponse().model_dump()

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict:
        _validated(types.CreateSessionRequest, await request.body())
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        service.sessions.add(session_id)
        return types.CreateSessionResponse(session_id=session_id).model_dump()

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat(request: Request) -> dict:
        body = _validated(types.SessionHeartbeatRequest, await request.body())
        if body.session_id not in service.sessions:  # 410: the SDK stops the session's heartbeats
            raise Refused(410, f"session_id: no live session {body.session_id!r} on this server")
        return types.SessionHeartbeatResponse().model_dump()

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str) -> dict:
        service.check_session(session_id)
        service.finish_session(session_id)
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> dict:
        return types.TelemetryResponse(status="accepted").model_dump()

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict:
        return service.capabilities().model_dump(exclude_none=True)

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict:
        body = _validated(types.CreateModelRequest, await request.body())
        service.check_new_model(body)
        return service.submit(lambda: service.create_model(body))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        body = _validated(types.GetInfoRequest, await request.body())
        return service.info(body.model_id).model_dump(mode="json", exclude_none=True)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        if request.headers.get("content-encoding"):
            raise Refused(
                415, "Content-Encoding: compressed bodies are not served (the server asks for none)"
            )
        trained, data, forward_only = parse_forward_backward(await request.body(), service)
        return service.submit(lambda: service.forward_backward(trained, data, forward_only), trained.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict:
        body = _validated(types.OptimStepRequest, await request.body())
        trained = service.model(body.model_id)
        if not isinstance(body.optim_params, types.AdamParams):
            raise Refused(400, "optim_params: only AdamParams are served")
        return service.submit(lambda: service.optim_step(trained, body.optim_params), trained.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict:
        body = _validated(types.SaveWeightsForSamplerRequest, await request.body())
        trained = service.model(body.model_id)
        if body.path is not None or body.sampling_session_seq_id is None:
            raise Refused(
                404,
                "save_weights_for_sampler(name=...) is not served yet: use save_weights_and_get_sampling_client",
            )
        if body.kind != "snapshot":
            raise Refused(400, f"kind: only snapshot samplers are served, got {body.kind!r}")
        return service.submit(lambda: service.save_for_sampler(trained, body), trained.model_id)

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict:
        sampler = service.sampler(sampler_id)
        return types.GetSamplerResponse(sampler_id=sampler_id, base_model=sampler.base_model).model_dump(
            exclude_none=True
        )

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict:
        body = _validated(types.SampleRequest, await request.body())
        sampler = service.sampler(body.sampling_session_id)
        asked = [
            name
            for name, value in (
                ("prompt_logprobs", body.prompt_logprobs),
                ("topk_prompt_logprobs", body.topk_prompt_logprobs),
                ("topk_sample_logprobs", body.topk_sample_logprobs),
                ("target_prompt_logprobs", body.target_prompt_logprobs),
                ("prompt_alt_tokens_k", body.prompt_alt_tokens_k),
                ("record_stability_info", body.record_stability_info),
            )
            if value
        ]
        if asked:
            raise Refused(
                404, f"{asked[0]}: not served yet (SamplingClient.compute_logprobs and top-k among them)"
            )
        try:
            prompt = body.prompt.to_ints()
        except ValueError:
            raise Refused(400, "prompt.chunks: only encoded_text chunks are served") from None
        if not prompt:
            raise Refused(400, "prompt: no tokens")
        vocab_size = int(sampler.engine.model.config.vocab_size)
        outside = [t for t in prompt if not 0 <= t < vocab_size]
        if outside:
            raise Refused(400, f"prompt: token {outside[0]} is outside the vocabulary (0..{vocab_size - 1})")
        if not 1 <= body.num_samples <= 128:
            raise Refused(400, f"num_samples: must be in 1..128, got {body.num_samples}")
        inference = InferenceRequest(
            prompt="",
            prompt_token_ids=prompt,
            n=body.num_samples,
            generation_args=generation_args(body.sampling_params),
        )

        async def sample() -> bytes:
            try:
                responses = await sampler.engine.agenerate(inference)
            except ValueError as exc:  # the engine's verdict on this request (too long, ...)
                raise Refused(400, str(exc)) from None
            return sample_response(responses)

        request_id = uuid.uuid4().hex
        service.futures[request_id] = asyncio.ensure_future(sample())
        return types.UntypedAPIFuture(
            request_id=request_id, sample_sequence_ids=[f"{request_id}:{i}" for i in range(body.num_samples)]
        ).model_dump(exclude_none=True)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = _validated(types.FutureRetrieveRequest, await request.body())
        return await service.retrieve(body.request_id)

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def not_served(request: Request, rest: str) -> JSONResponse:
        path = request.url.path
        call = NOT_SERVED_YET.get(path)
        if call is None and path.startswith("/api/v1/training_runs"):
            call = "RestClient's training runs and checkpoints"
        what = f"{call} ({path})" if call else path
        return error_response(404, f"{what} is not served yet by llmrl serve-tinker")

    return app


def serve_tinker(
    model_specs: list[str],
    *,
    host: str = DEFAULT_HOST,
    port: int = 8000,
    lora_rank_max: int = 64,
    seed: int = 0,
) -> None:
    """Serve the Tinker API over `model_specs` (on the GPU when there is one) until interrupted."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    service = TinkerService(
        base_specs=list(model_specs),
        lora_rank_max=lora_rank_max,
        device=device,
        seed=seed,
    )
    for spec in model_specs:  # loaded before the first request: a bad spec fails the command, not a call
        service.load_base(spec)
    try:
        run_server(create_tinker_app(service), host, port)
    finally:
        service.close()
