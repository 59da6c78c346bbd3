"""The environment server: a run config's environments over HTTP (`llmrl serve-env CONFIG`).

A trainer on another machine draws rollout groups and evaluations from these environments with a
`RemoteAgent`. Each request names the inference endpoint (an OpenAI-compatible base URL) that the
environments call back to sample completions; the server scores them and returns token rollouts.

* The agents are built once, from the local config file, when the app is created (plug-ins of that
  file are imported then). A request chooses among them by `env_id` and never names agent types,
  plug-ins, import paths or code; every body is validated (unknown fields are errors).
* Requests carry no secrets: the token for the inference server comes from the server's side
  (``inference.api_key_env`` of its config), and goes only to the allowed inference URLs
  (``inference.base_url`` of the config and ``--inference-url``). When any are configured, a
  request naming another URL is refused with 403, so the server cannot be sent to call elsewhere.
* Calls that draw training problems from the same environment are served one at a time (an
  `asyncio.Lock` per environment), so the problem order depends only on the order of requests, and
  `GET /v1/state` / `POST /v1/state` save and restore it for an exact resume.

Endpoints: ``POST /v1/group_rollouts``, ``POST /v1/evaluate``, ``GET /v1/info``, ``GET /v1/state``,
``POST /v1/state``, ``GET /healthz``. See docs/environment_server.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from llmrl.agents import Agent, WeightedMultiTask, build_agents
from llmrl.config import ConfigError, RunConfig
from llmrl.inference.interface import InferenceInterface
from llmrl.registry import import_plugins
from llmrl.server.common import DEFAULT_HOST, error_response, run_server, secure_app
from llmrl.types import (
    AgentStates,
    EnvironmentInfo,
    EvaluateRequest,
    EvaluateResponse,
    GroupRolloutsRequest,
    GroupRolloutsResponse,
    InferenceEndpoint,
    ServerInfo,
    check_http_url,
)

if TYPE_CHECKING:
    from llmrl.inference.openai import OpenAIInterface

log = logging.getLogger(__name__)

DEFAULT_PORT = 8100
MAX_BODY_BYTES = 1 << 20

ENDPOINTS = [
    "POST /v1/group_rollouts",
    "POST /v1/evaluate",
    "GET /v1/info",
    "GET /v1/state",
    "POST /v1/state",
    "GET /healthz",
]

# ---------------------------------------------------------------------------------------------
# The environments behind the routes


class RequestError(Exception):
    """A request the server understood but cannot serve; becomes `error_response(status, message)`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


InferenceFactory = Callable[[InferenceEndpoint], InferenceInterface]


class EnvironmentService:
    """The config's agents, built once, with one lock per environment's training-problem order."""

    def __init__(self, config: RunConfig, inference_factory: InferenceFactory):
        import_plugins(config.plugins)  # the local file's plug-ins; requests can never name any
        algorithm = config.algorithm
        self.mix = build_agents(
            config.environments,
            config.seed,
            dynamic_sampling=algorithm.dynamic_sampling,
            max_resample_rounds=algorithm.max_resample_rounds,
            model_spec=config.model.spec,
        )
        self.mix.check_problems()
        self.inference_factory = inference_factory
        self.configs = {env.name: env for env in config.environments}
        self.agents: dict[str, Agent] = {agent.env_id: agent for agent in self.mix.agents}
        # One environment served alone keeps the mix's failure isolation and dynamic sampling.
        self.single = {
            env_id: WeightedMultiTask(
                [agent],
                [1.0],
                dynamic_sampling=algorithm.dynamic_sampling,
                max_resample_rounds=algorithm.max_resample_rounds,
            )
            for env_id, agent in self.agents.items()
        }
        self.training_ids = [
            a.env_id for a, w in zip(self.mix.agents, self.mix.weights, strict=True) if w > 0
        ]
        self._locks: dict[str, asyncio.Lock] = {}
        self._locks_loop: asyncio.AbstractEventLoop | None = None

    def _known(self, env_id: str) -> str:
        if env_id not in self.agents:
            raise RequestError(404, f"unknown env_id {env_id!r}; this server has {sorted(self.agents)}")
        return env_id

    @contextlib.asynccontextmanager
    async def _holding(self, env_ids: Iterable[str]) -> AsyncIterator[None]:
        """Hold the locks of `env_ids`, taken in sorted order so that overlapping sets never deadlock."""
        loop = asyncio.get_running_loop()
        if self._locks_loop is not loop:  # a lock belongs to one loop (tests run several in turn)
            self._locks, self._locks_loop = {env_id: asyncio.Lock() for env_id in self.agents}, loop
        async with contextlib.AsyncExitStack() as stack:
            for env_id in sorted(set(env_ids)):
                await stack.enter_async_context(self._locks[env_id])
            yield

    async def group_rollouts(self, request: GroupRolloutsRequest) -> GroupRolloutsResponse:
        """Groups from one environment or the weighted mix, drawn while holding their problem orders."""
        if request.env_id is None:
            agents, env_ids = self.mix, self.training_ids
            if request.num_groups < len(env_ids):
                raise RequestError(
                    422,
                    f"num_groups={request.num_groups} is fewer than the {len(env_ids)} training environments "
                    f"{env_ids}; ask for more groups or name one env_id",
                )
        else:
            env_id = self._known(request.env_id)
            if self.configs[env_id].evaluation_only:
                raise RequestError(409, f"environment {env_id!r} is evaluation-only on this server")
            agents, env_ids = self.single[env_id], [env_id]
        inference = self.inference_factory(request.inference)
        async with self._holding(env_ids):
            groups = await agents.group_rollouts(
                inference, request.num_groups, request.group_size, request.generation_args
            )
            metrics = agents.pop_metrics()
        return GroupRolloutsResponse(groups=groups, metrics=metrics)

    async def evaluate(self, request: EvaluateRequest) -> EvaluateResponse:
        """Held-out evaluation; it never touches the training order, so it takes no lock."""
        agents = self.mix if request.env_id is None else self.single[self._known(request.env_id)]
        results = await agents.evaluate(
            self.inference_factory(request.inference),
            request.num_prompts,
            samples_per_prompt=request.samples_per_prompt,
            ks=request.ks,
            greedy=request.greedy,
            correct_threshold=request.correct_threshold,
            generation_args=request.generation_args,
        )
        return EvaluateResponse(results={env_id: response.results for env_id, response in results.items()})

    def info(self) -> ServerInfo:
        """The environments (as configured, with problem counts) and the routes."""
        return ServerInfo(
            environments=[
                EnvironmentInfo(
                    env_id=env_id,
                    agent_type=self.configs[env_id].agent_type,
                    weight=self.configs[env_id].weight,
                    evaluation_only=self.configs[env_id].evaluation_only,
                    num_train_problems=_count(agent, "train_problems"),
                    num_eval_problems=_count(agent, "eval_problems"),
                )
                for env_id, agent in self.agents.items()
            ],
            endpoints=ENDPOINTS,
        )

    async def state(self) -> AgentStates:
        """Every environment's problem order, between calls that draw from it."""
        async with self._holding(self.agents):
            return AgentStates(state={env_id: agent.state_dict() for env_id, agent in self.agents.items()})

    async def load_state(self, states: AgentStates) -> AgentStates:
        """Restore the given environments (others keep theirs); all of them or, on an error, none."""
        for env_id in states.state:
            self._known(env_id)
        async with self._holding(states.state):
            before = {env_id: self.agents[env_id].state_dict() for env_id in states.state}
            loaded: list[str] = []
            try:
                for env_id, state in states.state.items():
                    self.agents[env_id].load_state_dict(state)
                    loaded.append(env_id)
            except (ValueError, KeyError, TypeError) as exc:
                for env_id, state in before.items():  # the failing agent may have taken part of its state
                    self.agents[env_id].load_state_dict(state)
                failed = next(e for e in states.state if e not in loaded)
                detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
                raise RequestError(422, f"state.{failed}: does not fit this environment: {detail}") from None
            return AgentStates(state={env_id: self.agents[env_id].state_dict() for env_id in loaded})


def _count(agent: Agent, attribute: str) -> int | None:
    """Size of an agent's problem list when it has one (remote or streaming agents may not)."""
    problems = getattr(agent, attribute, None)
    return len(problems) if isinstance(problems, Sequence) else None


# ---------------------------------------------------------------------------------------------
# The app


def same_endpoint_url(url: str) -> str:
    """The form two base URLs are compared in: scheme and host lower-cased, no trailing slash or ``/v1``."""
    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{path}"


class OpenAIEndpoints:
    """The default inference factory: one `OpenAIInterface` per endpoint, reused by later requests to it.

    `api_key` is sent only to the endpoints in `token_urls` (see `same_endpoint_url`).
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        token_urls: Sequence[str] = (),
        timeout_s: float = 120.0,
        max_concurrent: int = 64,
    ):
        self.api_key = api_key
        self.token_urls = frozenset(map(same_endpoint_url, token_urls))
        self.timeout_s = timeout_s
        self.max_concurrent = max_concurrent
        self.interfaces: dict[InferenceEndpoint, OpenAIInterface] = {}

    def __call__(self, endpoint: InferenceEndpoint) -> InferenceInterface:
        if endpoint not in self.interfaces:
            from llmrl.inference.openai import OpenAIInterface  # only servers that call an endpoint need it

            allowed = same_endpoint_url(endpoint.base_url) in self.token_urls
            self.interfaces[endpoint] = OpenAIInterface(
                endpoint.base_url,
                api_key=self.api_key if allowed else None,
                model=endpoint.model,
                timeout_s=self.timeout_s,
                max_concurrent=self.max_concurrent,
            )
        return self.interfaces[endpoint]

    async def aclose(self) -> None:
        """Close the interfaces' connections."""
        for interface in self.interfaces.values():
            await interface.aclose()
        self.interfaces.clear()


def create_env_app(
    config: RunConfig,
    *,
    api_key: str | None = None,
    inference_api_key: str | None = None,
    inference_urls: Sequence[str] = (),
    inference_factory: InferenceFactory | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The environment server for `config`'s environments (built and checked here, once).

    Args:
        api_key: bearer token every request must carry (None: no auth; bind to loopback then).
        inference_api_key: token the default factory sends to the inference endpoints, only to
            those in `inference_urls`.
        inference_urls: the inference base URLs requests may name (the allowlist); empty: any URL,
            and then no token may be configured.
        inference_factory: makes the interface a request's `inference` endpoint stands for
            (default: an `OpenAIInterface` per endpoint, with `config.inference` timeout and concurrency).
    """
    allowed = [check_http_url(url) for url in inference_urls]
    if inference_api_key is not None and not allowed:
        raise ConfigError(
            "an inference token is configured but no inference URL may receive it: set inference.base_url "
            "or pass --inference-url (requests could otherwise send the token anywhere)"
        )
    # The app closes the clients of the factory it makes; one it is given is its caller's to close.
    endpoints = None
    if inference_factory is None:
        inference_factory = endpoints = OpenAIEndpoints(
            api_key=inference_api_key,
            token_urls=allowed,
            timeout_s=config.inference.request_timeout_s,
            max_concurrent=config.inference.resolved_max_concurrent,
        )
    service = EnvironmentService(config, _allowlisted(inference_factory, allowed))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if endpoints is not None:
            await endpoints.aclose()

    app = FastAPI(title="llmrl environment server", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    @app.post("/v1/group_rollouts", response_model=GroupRolloutsResponse)
    async def group_rollouts(body: GroupRolloutsRequest) -> Response:
        return _json(await service.group_rollouts(body))

    @app.post("/v1/evaluate", response_model=EvaluateResponse)
    async def evaluate(body: EvaluateRequest) -> Response:
        return _json(await service.evaluate(body))

    @app.get("/v1/info", response_model=ServerInfo)
    async def info() -> Response:
        return _json(service.info())

    @app.get("/v1/state", response_model=AgentStates)
    async def get_state() -> Response:
        return _json(await service.state())

    @app.post("/v1/state", response_model=AgentStates)
    async def set_state(body: AgentStates) -> Response:
        return _json(await service.load_state(body))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return secure_app(app, api_key=api_key, max_body_bytes=max_body_bytes)


def _allowlisted(factory: InferenceFactory, urls: Sequence[str]) -> InferenceFactory:
    """`factory`, refusing (403) endpoints outside `urls` when there are any."""
    if not urls:
        return factory
    allowed = {same_endpoint_url(url) for url in urls}

    def checked(endpoint: InferenceEndpoint) -> InferenceInterface:
        if same_endpoint_url(endpoint.base_url) not in allowed:
            raise RequestError(
                403, f"inference.base_url: {endpoint.base_url!r} is not an inference URL this server may call"
            )
        return factory(endpoint)

    return checked


def _json(model: BaseModel) -> Response:
    # Serialised directly: FastAPI would validate a large batch of rollouts again on the way out.
    return Response(model.model_dump_json(), media_type="application/json")


def serve_env(
    config: RunConfig,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    inference_urls: Sequence[str] = (),
) -> None:
    """Serve the environments of `config` until interrupted.

    The token for the inference endpoints is read from the environment variable the config's
    ``inference.api_key_env`` names; requests may name only the config's ``inference.base_url`` and
    `inference_urls` (any URL when there is none of them, and then no token).
    """
    inference_api_key = None
    if config.inference.api_key_env:
        inference_api_key = os.environ.get(config.inference.api_key_env)
        if not inference_api_key:
            raise ConfigError(
                f"inference.api_key_env: environment variable {config.inference.api_key_env} is not set"
            )
    allowed = [*([config.inference.base_url] if config.inference.base_url else []), *inference_urls]
    app = create_env_app(config, api_key=api_key, inference_api_key=inference_api_key, inference_urls=allowed)
    log.info("serving environments %s on http://%s:%d", [e.name for e in config.environments], host, port)
    run_server(app, host, port)
