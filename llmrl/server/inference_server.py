"""An OpenAI-compatible HTTP server over the embedded engine, with token ids, logprobs and weight sync.

``POST /v1/completions`` and ``POST /v1/chat/completions`` take the usual OpenAI fields and answer
in OpenAI's shapes, so the official ``openai`` client and other tools work against it. Training
needs more than text, so every response also carries the llmrl extensions: the whole prompt's
``prompt_token_ids`` and the ``policy_version`` at the top level, and per choice the completion's
``token_ids`` and ``token_logprobs`` (of the distribution each token was sampled from, float32; see
`llmrl.types`), and ``version_changes`` where in-flight weight updates took over mid-completion. Requests may add vLLM's sampling extensions ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids`` and (chat)
``chat_template_kwargs``, and ``prompt_token_ids`` (continue after these exact ids: multi-turn
rollouts never re-tokenise earlier turns). A completions prompt may be token ids, and vLLM's
``prompt_logprobs: k`` scores the prompt token by token (a served distillation teacher), at the request's
temperature, stated in ``prompt_logprobs_temperature``. ``POST /tokenize`` answers as vLLM's does, so that
a client can check that the server's tokenizer is its own.

Concurrent requests share the engine's continuous batch: the engine steps it as a task on the
server's event loop. ``POST /v1/weights`` loads new weights, versioned, between two decode steps
(from a file inside the server's ``weights_dir``, or from safetensors bytes in the body); the
answer comes once they serve. docs/serving.md describes the protocol.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
import uuid
from itertools import accumulate
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError
from safetensors import SafetensorError
from starlette.types import ASGIApp, Receive, Scope, Send

from llmrl.errors import UserError
from llmrl.inference.decoder import CudaGraphs
from llmrl.inference.engine import LocalEngine, WeightUpdateMode
from llmrl.inference.kv_cache import max_positions
from llmrl.server.common import DEFAULT_HOST, error_response, resolve_api_key, run_server, secure_app
from llmrl.types import (
    MAX_POLICY_VERSION,
    ChatBody,
    ChatMessage,
    CompletionBody,
    GenerationArgs,
    GenerationFields,
    InferenceRequest,
    InferenceResponse,
    WeightsByPath,
    validation_problems,
)

MIB = 1024**2
GIB = 1024**3
WEIGHTS_PATH = "/v1/weights"

# OpenAI and vLLM fields this server does not implement. A request may send them only with a value
# that changes nothing (absent, null, false, 0, empty, or the value listed here); anything else is
# refused rather than silently ignored, since it would change what is sampled.
_NEUTRAL_VALUES: dict[str, Any] = {"best_of": 1, "response_format": {"type": "text"}}
_UNSUPPORTED = tuple(
    "stream echo best_of suffix logit_bias frequency_penalty tools functions response_format".split()
)


class RequestRefused(Exception):
    """A request the server answers with `status` and `message` (4xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class TokenizeBody(BaseModel):
    """vLLM's ``POST /tokenize`` of a text (its chat form aside); other fields are refused."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class _InferenceServer:
    """The routes' state and logic; `create_inference_app` wires them to two FastAPI apps."""

    def __init__(self, engine: LocalEngine, model_name: str, weights_dir: Path | None, max_n: int):
        self.engine = engine
        self.model_name = model_name
        self.weights_dir = weights_dir
        self.max_n = max_n
        self.created = int(time.time())
        self._weights_lock = threading.Lock()  # one update at a time: version check and load are one step

    # -- generation ------------------------------------------------------------------------------

    async def generate(
        self, body: GenerationFields, prompt: str | list[ChatMessage], chat: bool
    ) -> JSONResponse:
        try:
            request = self._inference_request(body, prompt)
            responses = await self.engine.agenerate(request)
        except ValidationError as exc:
            raise RequestRefused(400, validation_problems(exc.errors())) from None
        except ValueError as exc:  # the engine's verdict on this request (prompt too long, ...)
            raise RequestRefused(400, str(exc)) from None
        answer = self._openai_response(body, responses, chat)
        if isinstance(body, CompletionBody) and body.prompt_logprobs is not None:
            await self._add_prompt_logprobs(answer, responses[0].prompt_token_ids, body)
        return JSONResponse(answer)

    async def _add_prompt_logprobs(self, answer: dict, prompt_ids: list[int], body: CompletionBody) -> None:
        """vLLM's ``prompt_logprobs`` in each choice, here of the distribution at the request's temperature
        (1 for greedy requests, as their completions' logprobs), which ``prompt_logprobs_temperature``
        states: vLLM's are always at temperature 1."""
        assert body.prompt_logprobs is not None
        temperature = body.temperature or 1.0
        scored = await asyncio.to_thread(
            self.engine.prompt_logprobs, prompt_ids, body.prompt_logprobs, temperature
        )
        unique = sorted({*prompt_ids, *scored.top_ids.flatten().tolist()})
        pieces = dict(zip(unique, self.engine.tokenizer.batch_decode([[t] for t in unique]), strict=True))
        entries: list[dict[str, dict[str, Any]] | None] = [None]  # the first token has no context
        for token, logprob, rank, top_ids, top_logprobs in zip(
            prompt_ids[1:],
            scored.token_logprobs.tolist(),
            scored.ranks.tolist(),
            scored.top_ids.tolist(),
            scored.top_logprobs.tolist(),
            strict=True,
        ):
            entry = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": pieces[token]}}
            for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs, strict=True), 1):
                entry.setdefault(
                    str(top_id), {"logprob": top_logprob, "rank": top_rank, "decoded_token": pieces[top_id]}
                )
            entries.append(entry)
        for choice in answer["choices"]:
            choice["prompt_logprobs"] = entries
        answer["prompt_logprobs_temperature"] = temperature

    def _inference_request(self, body: GenerationFields, prompt: str | list[ChatMessage]) -> InferenceRequest:
        _refuse_unsupported(body)
        if body.n > self.max_n:
            raise RequestRefused(400, f"n: at most {self.max_n} completions per request, got {body.n}")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        args = GenerationArgs(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            chat_template_kwargs=getattr(body, "chat_template_kwargs", None),
            max_tokens=body.completion_limit(),
            stop=tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            seed=body.seed,
        )
        return InferenceRequest(
            prompt=prompt, generation_args=args, n=body.n, prompt_token_ids=body.prompt_token_ids
        )

    def _openai_response(
        self, body: GenerationFields, responses: list[InferenceResponse], chat: bool
    ) -> dict:
        want_logprobs = body.logprobs is not None and body.logprobs is not False
        prompt_tokens = len(responses[0].prompt_token_ids)
        completion_tokens = sum(len(r.token_ids) for r in responses)
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.model or self.model_name,
            "choices": [self._choice(i, r, chat, want_logprobs) for i, r in enumerate(responses)],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "prompt_token_ids": responses[0].prompt_token_ids,
            "policy_version": responses[0].policy_version,
        }

    def _choice(self, index: int, response: InferenceResponse, chat: bool, want_logprobs: bool) -> dict:
        output = (
            {"message": {"role": "assistant", "content": response.text}} if chat else {"text": response.text}
        )
        return {
            "index": index,
            **output,
            "finish_reason": response.finish_reason,
            "logprobs": self._openai_logprobs(response, chat) if want_logprobs else None,
            "token_ids": response.token_ids,
            "token_logprobs": response.logprobs,
            "version_changes": response.version_changes,
        }

    def _openai_logprobs(self, response: InferenceResponse, chat: bool) -> dict:
        """The sampled tokens' logprobs in OpenAI's shape (no alternatives: `top_logprobs` stays empty)."""
        pieces = self.engine.tokenizer.batch_decode([[t] for t in response.token_ids])
        values = response.logprobs or []
        if chat:
            content = [
                {"token": piece, "logprob": value, "bytes": list(piece.encode()), "top_logprobs": []}
                for piece, value in zip(pieces, values, strict=True)
            ]
            return {"content": content, "refusal": None}
        offsets = list(accumulate((len(piece) for piece in pieces[:-1]), initial=0))[: len(pieces)]
        return {"tokens": pieces, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}

    # -- weights ---------------------------------------------------------------------------------

    async def update_weights(self, request: Request) -> JSONResponse:
        content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if content_type == "application/octet-stream":
            version = _query_version(request)
            reset = request.query_params.get("reset", "").lower() in ("1", "true")
            early = self._version_answer(version, reset)
            if early is not None:
                return early
            upload = await _receive_to_file(request)
            try:
                _refuse_pickles(upload)
                return await asyncio.to_thread(self._apply_weights, upload, version, reset)
            finally:
                upload.unlink(missing_ok=True)
        if content_type not in ("", "application/json"):
            raise RequestRefused(
                415, "Content-Type: application/json (a path) or application/octet-stream (safetensors bytes)"
            )
        body = await request.body()  # JSON: `secure_app` bounded it by max_body_bytes and checked it
        try:
            update = WeightsByPath.model_validate_json(body)
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        path = self._weights_path(update.path)
        return await asyncio.to_thread(self._apply_weights, path, update.version, update.reset)

    def _version_answer(self, version: int, reset: bool) -> JSONResponse | None:
        """The answer to a version not newer than the served one (no-op or 409); None to load it."""
        if reset:
            return None
        current = self.engine.policy_version
        if version == current:
            return JSONResponse({"policy_version": current, "seconds": 0.0, "applied": False})
        if version < current:
            return error_response(409, f"version {version} is older than the served version {current}")
        return None

    def _apply_weights(self, source: Path, version: int, reset: bool) -> JSONResponse:
        """Load `source` as `version` (worker thread: the event loop keeps stepping the batch meanwhile)."""
        with self._weights_lock:
            early = self._version_answer(version, reset)
            if early is not None:
                return early
            start = time.perf_counter()
            try:
                self.engine.update_weights(source, version)
            except (ValueError, SafetensorError) as exc:  # unreadable file, unknown keys, wrong shapes
                return error_response(
                    400, f"weights: {exc}"
                )  # checked before loading: the old weights serve on
            seconds = time.perf_counter() - start
        return JSONResponse({"policy_version": version, "seconds": round(seconds, 6), "applied": True})

    def _weights_path(self, requested: str) -> Path:
        if self.weights_dir is None:
            raise RequestRefused(
                400,
                "path: this server has no weights folder (--weights-dir); send the "
                "safetensors bytes with Content-Type: application/octet-stream instead",
            )
        path = (self.weights_dir / requested).resolve()
        if self.weights_dir not in path.parents:
            raise RequestRefused(403, f"path: {requested!r} is not inside the server's weights folder")
        if not path.exists():
            raise RequestRefused(400, f"path: {requested!r} does not exist in the server's weights folder")
        _refuse_pickles(path)
        return path

    # -- status ----------------------------------------------------------------------------------

    def models(self) -> dict:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "llmrl",
            "policy_version": self.engine.policy_version,
        }
        return {"object": "list", "data": [card]}

    def health(self) -> dict:
        return {"status": "ok", "policy_version": self.engine.policy_version}

    def tokenize(self, body: TokenizeBody) -> dict:
        tokenizer = self.engine.tokenizer
        tokens = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        return {
            "count": len(tokens),
            "max_model_len": max_positions(self.engine.model.config),
            "tokens": tokens,
            "token_strs": tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
        }


def _refuse_unsupported(body: GenerationFields) -> None:
    extra = body.model_extra or {}
    for name in _UNSUPPORTED:
        value = extra.get(name)
        if value and value != _NEUTRAL_VALUES.get(name):
            raise RequestRefused(400, f"{name} is not supported by this server (got {value!r})")


def _query_version(request: Request) -> int:
    raw = request.query_params.get("version", "")
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_POLICY_VERSION:
        raise RequestRefused(
            422,
            f"query.version: an integer in 0..{MAX_POLICY_VERSION} is required with streamed weights (?version=N)",
        )
    return int(raw)


def _refuse_pickles(path: Path) -> None:
    """Only safetensors are loaded: a pickle (``torch.save``, ``.pt``/``.bin``) can run code when read."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise RequestRefused(400, f"weights: {path.name} holds no .safetensors files (pickles are refused)")
    for file in files:
        if file.suffix != ".safetensors" or not _shaped_like_safetensors(file):
            raise RequestRefused(
                400, f"weights: {file.name} is not a safetensors file (pickles from torch.save are refused)"
            )


def _shaped_like_safetensors(path: Path) -> bool:
    """An 8-byte little-endian header length that fits the file, then the header's JSON object."""
    with open(path, "rb") as file:
        head = file.read(9)
    if len(head) < 9:
        return False
    return head[8:9] == b"{" and 8 + int.from_bytes(head[:8], "little") <= path.stat().st_size


async def _receive_to_file(request: Request) -> Path:
    """Write the streamed body to a temporary .safetensors file (the app's body limit bounds its size)."""
    handle, name = tempfile.mkstemp(prefix="llmrl-weights-", suffix=".safetensors")
    path = Path(name)
    try:
        with os.fdopen(handle, "wb") as file:
            async for chunk in request.stream():
                file.write(chunk)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


class _RouteWeights:
    """ASGI middleware: sends ``/v1/weights`` to its own app, whose body limit is the weights limit."""

    def __init__(self, app: ASGIApp, weights_app: ASGIApp):
        self.app = app
        self.weights_app = weights_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = self.weights_app if scope["type"] == "http" and scope["path"] == WEIGHTS_PATH else self.app
        await target(scope, receive, send)


def create_inference_app(
    engine: LocalEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    weights_dir: str | Path | None = None,
    max_body_bytes: int = 4 * MIB,
    max_weights_bytes: int = 16 * GIB,
    max_n: int = 64,
) -> FastAPI:
    """The OpenAI-compatible app serving `engine` (routes in the module docstring and docs/serving.md).

    Args:
        engine: the engine to serve; its continuous batch is shared by all requests.
        model_name: the id reported by ``/v1/models`` and in responses that name no model.
        api_key: bearer token every route requires (None: no auth).
        weights_dir: the folder ``POST /v1/weights`` may load files from (None: streamed bytes only).
        max_body_bytes: limit of a generation request's body.
        max_weights_bytes: limit of a streamed safetensors body.
        max_n: most completions per request.
    """
    folder = None
    if weights_dir is not None:
        folder = Path(weights_dir).resolve()
        if not folder.is_dir():
            raise UserError(f"weights_dir: {weights_dir} is not a folder")
    server = _InferenceServer(engine, model_name, folder, max_n)
    app = secure_app(FastAPI(title="llmrl inference"), api_key=api_key, max_body_bytes=max_body_bytes)
    weights_app = secure_app(
        FastAPI(), api_key=api_key, max_body_bytes=max_weights_bytes, max_json_bytes=max_body_bytes
    )
    for target in (app, weights_app):
        target.add_exception_handler(RequestRefused, _refused)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> JSONResponse:
        if isinstance(body.prompt, list):  # token ids: completed as they are
            if body.prompt_token_ids is not None:
                raise RequestRefused(400, "prompt: token ids leave no room for prompt_token_ids")
            body = body.model_copy(update={"prompt": "", "prompt_token_ids": body.prompt})
        assert isinstance(body.prompt, str)
        return await server.generate(body, body.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> JSONResponse:
        return await server.generate(body, [m.to_chat_message() for m in body.messages], chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return server.models()

    @app.get("/healthz")
    async def health() -> dict:
        return server.health()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict:
        return server.tokenize(body)

    @weights_app.post(WEIGHTS_PATH)
    async def update_weights(request: Request) -> JSONResponse:
        return await server.update_weights(request)

    app.add_middleware(_RouteWeights, weights_app=weights_app)
    return app


async def _refused(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestRefused)
    return error_response(exc.status, exc.message)


def serve_inference(
    model_spec: str,
    *,
    model_name: str | None = None,
    host: str = DEFAULT_HOST,
    port: int = 8000,
    api_key: str | None = None,
    weights_dir: str | Path | None = None,
    dtype: str = "float32",
    seed: int = 0,
    max_batch_tokens: int = 8192,
    max_concurrent: int = 64,
    weight_update: WeightUpdateMode = "wait",
    cuda_graphs: CudaGraphs = "auto",
) -> None:
    """Load `model_spec` (on the GPU when there is one) and serve it until interrupted, under the id
    `model_name` (default: `model_spec`; ``llmrl serve-inference``'s ``--model``, where it loads a
    folder that stands for the run or checkpoint named).

    The bearer token is `api_key`, else the ``LLMRL_API_KEY`` environment variable, else none.
    """
    import torch

    from llmrl.models import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(model_spec, dtype=dtype, device=device)
    engine = LocalEngine(
        model,
        tokenizer,
        max_batch_tokens=max_batch_tokens,
        max_concurrent=max_concurrent,
        weight_update=weight_update,
        seed=seed,
        owns_model=True,
        cuda_graphs=cuda_graphs,
    )
    app = create_inference_app(
        engine,
        model_name=model_name or model_spec,
        api_key=resolve_api_key(api_key),
        weights_dir=weights_dir,
    )
    run_server(app, host, port)
