"""The HTTP routes the official ``tinker`` SDK calls, over a `TinkerService`, and the command that serves
them."""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from tinker import types

from llmrl.server.common import DEFAULT_HOST, error_response, run_server, secure_app
from llmrl.server.tinker.checkpoints import delete_checkpoint, list_checkpoints
from llmrl.server.tinker.service import TinkerService
from llmrl.server.tinker.wire import (
    Refused,
    WeightsInfoRequest,
    generation_args,
    parse_forward_backward,
    prompt_logprobs,
    sample_response,
    validated,
)
from llmrl.types import InferenceRequest

MIB = 1024**2
# The SDK's calls this server does not do yet, by route, so that the refusal names the call.
log = logging.getLogger(__name__)

NOT_SERVED_YET = {
    "/api/v1/save_weights_external": "TrainingClient.save_weights_external",
    "/api/v1/join_sampling_session": "an unpickled SamplingClient",
    "/api/v1/retrieve_futures": "the session futures poller",
    "/api/v1/create_custom_loss": "ServiceClient.create_custom_loss",
    "/api/v1/copy_weights": "RestClient.copy_weights",
    "/api/v1/unload_model": "TrainingClient.unload_model",
    "/api/v1/cancel_future": "cancelling a sample",
    "/api/v1/auth/token": "JWT authentication",
}


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
        validated(types.ClientConfigRequest, await request.body())
        # Plain httpx transport: nothing here needs the SDK's reqwest one.
        return types.ClientConfigResponse(use_pyqwest_transport=False).model_dump()

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config(request: Request) -> dict:
        validated(types.ClientConfigRequest, await request.body())
        return types.ClientDynamicConfigResponse().model_dump()

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict:
        validated(types.CreateSessionRequest, await request.body())
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        service.sessions.add(session_id)
        return types.CreateSessionResponse(session_id=session_id).model_dump()

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat(request: Request) -> dict:
        body = validated(types.SessionHeartbeatRequest, await request.body())
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
        body = validated(types.CreateModelRequest, await request.body())
        service.check_new_model(body)
        return service.submit(lambda: service.create_model(body))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        body = validated(types.GetInfoRequest, await request.body())
        return service.info(body.model_id).model_dump(mode="json", exclude_none=True)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        if request.headers.get("content-encoding"):
            raise Refused(
                415, "Content-Encoding: compressed bodies are not served (the server asks for none)"
            )
        call = parse_forward_backward(await request.body(), service.limits)
        trained = service.model(call.model_id)
        return service.submit(lambda: service.forward_backward(trained, call), trained.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict:
        body = validated(types.OptimStepRequest, await request.body())
        trained = service.model(body.model_id)
        if not isinstance(body.optim_params, types.AdamParams):
            raise Refused(400, "optim_params: only AdamParams are served")
        return service.submit(lambda: service.optim_step(trained, body.optim_params), trained.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict:
        body = validated(types.SaveWeightsForSamplerRequest, await request.body())
        trained = service.model(body.model_id)
        if (body.path is None) == (body.sampling_session_seq_id is None):
            raise Refused(400, "path: give a name or a sampling_session_seq_id, one of them")
        if body.kind != "snapshot":
            raise Refused(400, f"kind: only snapshot samplers are served, got {body.kind!r}")
        return service.submit(lambda: service.save_for_sampler(trained, body), trained.model_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict:
        body = validated(types.SaveWeightsRequest, await request.body())
        trained = service.model(body.model_id)
        service.checkpoint_path(trained, "weights", body.path)
        return service.submit(lambda: service.save_state(trained, body), trained.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict:
        body = validated(types.LoadWeightsRequest, await request.body())
        if body.model_id is not None:
            service.model(body.model_id)
        return service.submit(lambda: service.load_state(body), body.model_id)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        body = validated(types.CreateSamplingSessionRequest, await request.body())
        service.check_session(body.session_id)
        if (body.model_path is None) == (body.base_model is None):
            raise Refused(400, "model_path: give a checkpoint path or a base_model, one of them")
        if body.base_model is not None:
            service.check_base(body.base_model, "base_model")
        # Loading a checkpoint takes a while: off the event loop, in line with the model work.
        sampler_id = await asyncio.get_running_loop().run_in_executor(
            service.worker, lambda: service.create_sampling_session(body)
        )
        return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id).model_dump()

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict:
        body = validated(WeightsInfoRequest, await request.body())
        return service.weights_info(body.tinker_path).model_dump(mode="json", exclude_none=True)

    @app.get("/api/v1/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0) -> dict:
        runs = service.training_runs()
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(runs))
        page = types.TrainingRunsResponse(training_runs=runs[offset : offset + limit], cursor=cursor)
        return page.model_dump(mode="json", exclude_none=True)

    @app.get("/api/v1/training_runs/{run_id}")
    async def training_run(run_id: str) -> dict:
        return service.training_run(run_id).model_dump(mode="json", exclude_none=True)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def run_checkpoints(run_id: str) -> dict:
        return types.CheckpointsListResponse(
            checkpoints=list_checkpoints(service.storage, run_id)
        ).model_dump(mode="json", exclude_none=True)

    @app.get("/api/v1/checkpoints")
    async def all_checkpoints(limit: int = 100, offset: int = 0) -> dict:
        checkpoints = list_checkpoints(service.storage)
        page = checkpoints[offset : offset + limit]
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(checkpoints))
        return types.CheckpointsListResponse(checkpoints=page, cursor=cursor).model_dump(
            mode="json", exclude_none=True
        )

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def remove_checkpoint(run_id: str, checkpoint_id: str) -> dict:
        delete_checkpoint(service.storage, run_id, checkpoint_id)
        return {}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict:
        sampler = service.sampler(sampler_id)
        return types.GetSamplerResponse(sampler_id=sampler_id, base_model=sampler.base_model).model_dump(
            exclude_none=True
        )

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict:
        body = validated(types.SampleRequest, await request.body())
        sampler = service.sampler(body.sampling_session_id)
        asked = [
            name
            for name, value in (
                ("topk_prompt_logprobs", body.topk_prompt_logprobs),
                ("topk_sample_logprobs", body.topk_sample_logprobs),
                ("target_prompt_logprobs", body.target_prompt_logprobs),
                ("prompt_alt_tokens_k", body.prompt_alt_tokens_k),
                ("record_stability_info", body.record_stability_info),
            )
            if value
        ]
        if asked:
            raise Refused(404, f"{asked[0]}: not served yet (top-k logprobs and the like)")
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

        last_n = body.prompt_logprobs_last_n
        if last_n is not None and not (body.prompt_logprobs and 1 <= last_n <= len(prompt) - 1):
            raise Refused(
                400,
                f"prompt_logprobs_last_n: must be in 1..{len(prompt) - 1} with prompt_logprobs, got {last_n}",
            )

        async def sample() -> bytes:
            try:
                responses = await sampler.engine.agenerate(inference)
            except ValueError as exc:  # the engine's verdict on this request (too long, ...)
                raise Refused(400, str(exc)) from None
            if not body.prompt_logprobs:
                return sample_response(responses)
            scored = await asyncio.to_thread(sampler.engine.prompt_logprobs, prompt, 1)
            return sample_response(responses, prompt_logprobs(scored.token_logprobs, last_n))

        request_id = uuid.uuid4().hex
        service.futures[request_id] = asyncio.ensure_future(sample())  # forgotten as `retrieve` says
        return types.UntypedAPIFuture(
            request_id=request_id, sample_sequence_ids=[f"{request_id}:{i}" for i in range(body.num_samples)]
        ).model_dump(exclude_none=True)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = validated(types.FutureRetrieveRequest, await request.body())
        return await service.retrieve(body.request_id)

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def not_served(request: Request, rest: str) -> JSONResponse:
        path = request.url.path
        call = NOT_SERVED_YET.get(path)
        if call is None and path.startswith("/api/v1/training_runs"):
            call = "RestClient's checkpoint publishing and TTLs"
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
    storage: Path = Path("tinker_storage"),
    max_samplers: int = 4,
) -> None:
    """Serve the Tinker API over `model_specs` (on the GPU when there is one) until interrupted; saved
    states live in `storage`."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    service = TinkerService(
        base_specs=list(model_specs),
        lora_rank_max=lora_rank_max,
        device=device,
        storage=storage,
        seed=seed,
        max_samplers=max_samplers,
    )
    log.info("checkpoints and tokenizers in %s", storage.resolve())
    for spec in model_specs:  # loaded before the first request: a bad spec fails the command, not a call
        service.load_base(spec)
    try:
        run_server(create_tinker_app(service), host, port)
    finally:
        service.close()
