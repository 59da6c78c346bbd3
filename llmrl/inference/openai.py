"""OpenAIInterface: the `InferenceInterface` over any OpenAI-compatible HTTP server.

Training needs the exact completion token ids and one logprob per token, which plain OpenAI
responses lack. Every request therefore asks for them in all the dialects this client knows:
llmrl's own server always answers with ``token_ids``/``token_logprobs``/``prompt_token_ids``;
vLLM (>= 0.10.2) and SGLang add ``token_ids`` and ``prompt_token_ids`` with ``return_token_ids``
(SGLang's chat also with ``return_prompt_token_ids``), and both give per-token logprobs with
``logprobs``. A response still missing any of them raises `UnsupportedServerError` naming the field:
such a server cannot be trained from. Weight sync (`update_weights`) speaks llmrl's
``POST /v1/weights`` through `llmrl.weights.llmrl_server` (docs/serving.md).

Requests go through `llmrl.http_client`: retried with exponential backoff on connection errors,
timeouts, 408/429 and 5xx, never on other 4xx (the server's message is raised at once). At most
`max_concurrent` requests are in flight
per event loop; each loop gets its own HTTP client, since `generate` runs every call in a new loop.
A request for more than `max_n` completions (the llmrl server's limit, 64) is sent in parts.

A request that continues from ``prompt_token_ids`` (multi-turn) goes to llmrl's server as it is: the
server renders the rest of the prompt after those ids. Servers without that extension (vLLM, SGLang)
take a list of token ids as a completions prompt instead: given the model's `tokenizer`, this client
renders the whole prompt into ids the way the embedded engine does (`llmrl.inference.prompts`) and
sends them to ``/completions``, so a conversation continues token for token whatever the server.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from llmrl.config import ConfigError, InferenceConfig, ModelConfig
from llmrl.http_client import HTTPRequestError, RetryPolicy, send
from llmrl.inference.completions import parse_finish_reason
from llmrl.inference.interface import (
    Health,
    InferenceInterface,
    Reachability,
    RequestRejected,
    run_blocking,
    run_sync,
)
from llmrl.inference.prompts import request_prompt_ids
from llmrl.seeding import derive_seed
from llmrl.types import InferenceRequest, InferenceResponse
from llmrl.weights import PayloadKind, WeightSyncError, WeightTransport, transport_for
from llmrl.weights.llmrl_server import LlmrlServerTransport

__all__ = [
    "InferenceServerError",
    "OpenAIInterface",
    "RequestRefusedByServer",
    "UnsupportedServerError",
    "WeightSyncError",
]


class InferenceServerError(RuntimeError):
    """The server refused a request (4xx), kept failing (5xx) or was unreachable (`status` None)."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


class RequestRefusedByServer(InferenceServerError, RequestRejected):
    """The server refused this generation request for what it holds (vLLM: a prompt longer than its
    max_model_len), not for how it is: the same request would be refused again."""


_REQUEST_REFUSALS = frozenset({400, 413, 422})
"""The statuses a server refuses a generation request's content with (bad request, too large,
unprocessable), as opposed to who asks (401, 403), where (404) or when (408, 429, 5xx)."""


class UnsupportedServerError(ValueError):
    """The server's answers lack what training needs (token ids, per-token logprobs, prompt continuation)."""


@dataclass
class _Session:
    """What belongs to one event loop: its HTTP client, its in-flight limit, and the lock under which
    the first request asks the server for its model's name."""

    client: httpx.AsyncClient
    slots: asyncio.Semaphore
    naming: asyncio.Lock = field(default_factory=asyncio.Lock)


class OpenAIInterface(InferenceInterface):
    """`InferenceInterface` over an OpenAI-compatible server: llmrl's own, vLLM or SGLang."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout_s: float = 120,
        max_concurrent: int = 64,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        weight_sync_timeout_s: float = 300,
        weights_dir: str | Path | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_n: int = 64,
        tokenizer: Any | None = None,
    ):
        """
        Args:
            base_url: the server's API root, with or without the trailing ``/v1``.
            api_key: bearer token the server requires (None: send none).
            model: model name sent with requests; None: the first id of the server's ``/v1/models``.
            timeout_s: limit of one attempt of a generation request, end to end.
            max_concurrent: most generation requests in flight at once (per event loop).
            max_retries: further attempts after a retryable failure; ``backoff_s * 2**attempt`` apart.
            weight_sync_timeout_s: limit of one `update_weights`, upload and load included.
            weights_dir: a folder this process and the server both read (a shared disk): weights are
                written there and sent as a path. None: they are streamed in the request body.
            transport: the httpx transport of every client (tests pass an ASGI or mock transport).
            max_n: most completions one request asks for (the llmrl server's default limit); a
                larger `n` is sent as several requests, each with its own seed derived from the request's.
            tokenizer: the served model's tokenizer: requests with ``prompt_token_ids`` are rendered
                into ids here and sent as a token prompt. None: they are sent with llmrl's
                ``prompt_token_ids`` extension, which only llmrl's server reads.
        """
        if not timeout_s > 0 or not weight_sync_timeout_s > 0:
            raise ValueError(f"timeouts must be > 0, got {timeout_s} and {weight_sync_timeout_s}")
        if max_concurrent < 1 or max_retries < 0 or backoff_s < 0 or max_n < 1:
            raise ValueError(
                f"need max_concurrent >= 1, max_retries >= 0, backoff_s >= 0 and max_n >= 1, got "
                f"{max_concurrent}, {max_retries}, {backoff_s} and {max_n}"
            )
        self.base_url = normalise_base_url(base_url)
        self.model = model
        self.timeout_s = timeout_s
        self.max_concurrent = max_concurrent
        self.max_n = max_n
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.weights_dir = Path(weights_dir).resolve() if weights_dir is not None else None
        self.tokenizer = tokenizer
        self._weights = LlmrlServerTransport(self._post_weights, self._run_closing, self.weights_dir)
        self._api_key = api_key
        self._transport = transport
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Session] = (
            weakref.WeakKeyDictionary()
        )
        self._sessions_lock = threading.Lock()
        self._reachability = Reachability()

    @classmethod
    def from_config(
        cls, config: InferenceConfig, model: ModelConfig, *, seed: int, run_dir: Path | None = None
    ) -> OpenAIInterface:
        """The client `config` describes (`seed` is unused: the server seeds requests that carry none;
        `run_dir` too: the client writes nothing there)."""
        del model, seed, run_dir
        if not config.base_url:
            raise ConfigError(
                "inference.base_url: required for inference type 'openai' (e.g. http://127.0.0.1:8000/v1)"
            )
        if isinstance(config.base_url, list):
            raise ConfigError(
                "inference.base_url: type 'openai' takes one URL; type 'vllm' spreads over several"
            )
        return cls(
            config.base_url,
            api_key=api_key_from_env(config.api_key_env),
            timeout_s=config.request_timeout_s,
            max_concurrent=config.resolved_max_concurrent,
            weights_dir=config.weights_dir,
            weight_sync_timeout_s=config.weight_sync_timeout_s,
        )

    @property
    def policy_version(self) -> int:
        """The version of the last successful `update_weights` (0 before any)."""
        return self._weights.version

    def health(self) -> Health:
        """The server, and since when requests have failed to reach it (no answer, or a 5xx one)."""
        return Health(
            servers=(self.base_url,),
            unreachable_since=self._reachability.since,
            shared_url=self.base_url,
            model=self.model,
        )

    def close(self) -> None:
        """Nothing to release: each blocking call closes the HTTP client of its own event loop."""

    # -- generation ------------------------------------------------------------------------------

    async def agenerate(
        self, request: InferenceRequest | dict[str, Any], *, model: str | None = None
    ) -> list[InferenceResponse]:
        """Sample `request.n` completions on the server, with their token ids and logprobs; `model`:
        the name to ask for instead of the server's model (a LoRA adapter's)."""
        if isinstance(request, dict):
            request = InferenceRequest.model_validate(request)
        if request.n > self.max_n:
            parts = await asyncio.gather(
                *(self.agenerate(part, model=model) for part in _split(request, self.max_n))
            )
            return [response for part in parts for response in part]
        prompt_ids = (
            request_prompt_ids(self.tokenizer, request)
            if request.prompt_token_ids is not None and self.tokenizer is not None
            else None
        )
        chat = prompt_ids is None and not isinstance(request.prompt, str)
        session = self._session()
        body = _request_body(request, model or await self._model_name(session), prompt_ids)
        async with session.slots:
            try:
                data = await self._call(
                    "POST",
                    "/chat/completions" if chat else "/completions",
                    json=body,
                    timeout_s=self.timeout_s,
                    retries=self.max_retries,
                )
            except InferenceServerError as exc:
                if exc.status in _REQUEST_REFUSALS:
                    raise RequestRefusedByServer(str(exc), status=exc.status) from None
                raise
        return _parse_responses(data, request, chat, self._weights.version)

    def generate(self, request: InferenceRequest | dict[str, Any]) -> list[InferenceResponse]:
        """Blocking form of `agenerate` (not from inside a running event loop)."""
        return run_sync(self._closing(self.agenerate(request)))

    async def aclose(self) -> None:
        """Close this event loop's HTTP client (`generate` and `update_weights` close their own)."""
        with self._sessions_lock:
            session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.client.aclose()

    # -- weights ---------------------------------------------------------------------------------

    def weight_transport(self, kind: PayloadKind) -> WeightTransport[Any]:
        """The transport to llmrl's server (`llmrl.weights.llmrl_server`: a file in `weights_dir`, or
        streamed), for whole weights and adapters alike.

        The server refuses a version older than the one it serves, and takes the one it serves as a
        no-op, unless `reset` is set: a trainer starting or resuming a run owns the version sequence
        and replaces whatever the server holds. A send raises `WeightSyncError` when the server
        refuses or does not answer within `weight_sync_timeout_s`.
        """
        return transport_for([self._weights], kind, f"llmrl's server at {self.base_url}")

    async def _post_weights(self, path: str, **request: Any) -> Any:
        try:
            return await self._call("POST", path, timeout_s=self.weight_sync_timeout_s, retries=0, **request)
        except InferenceServerError as exc:
            raise WeightSyncError(f"weight sync failed: {exc}", status=exc.status) from exc

    # -- HTTP ------------------------------------------------------------------------------------

    async def _call(self, method: str, path: str, *, timeout_s: float, retries: int, **kwargs: Any) -> Any:
        """One request, retried on retryable failures; the decoded JSON answer, or InferenceServerError."""
        policy = RetryPolicy(timeout_s, retries=retries, backoff_s=self.backoff_s)
        try:
            response = await send(
                self._session().client, method, path, policy, on_answer=self._reachability.observe, **kwargs
            )
        except HTTPRequestError as exc:
            raise InferenceServerError(str(exc), status=exc.status) from None
        try:
            return response.json()
        except ValueError:
            raise InferenceServerError(
                f"{method} {self.base_url}{path}: the answer is not JSON: {response.text[:200]!r}",
                status=response.status_code,
            ) from None

    async def _model_name(self, session: _Session) -> str:
        """The server's model, asked once: thousands of requests that start together would otherwise each
        ask, past the in-flight limit, and httpx's pool would spend its time queueing them."""
        async with session.naming:
            if self.model is None:
                data = await self._call("GET", "/models", timeout_s=self.timeout_s, retries=self.max_retries)
                try:
                    self.model = str(data["data"][0]["id"])
                except (KeyError, IndexError, TypeError):
                    raise InferenceServerError(
                        f"GET {self.base_url}/models lists no model; pass model=..."
                    ) from None
        return self.model

    def _session(self) -> _Session:
        loop = asyncio.get_running_loop()
        with self._sessions_lock:
            session = self._sessions.get(loop)
            if session is None:
                headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
                client = httpx.AsyncClient(
                    base_url=self.base_url,
                    headers=headers,
                    transport=self._transport,
                    limits=httpx.Limits(max_connections=self.max_concurrent + 1),
                )
                session = self._sessions[loop] = _Session(client, asyncio.Semaphore(self.max_concurrent))
        return session

    def _run_closing(self, coroutine: Coroutine[Any, Any, None]) -> None:
        run_blocking(self._closing(coroutine))

    async def _closing(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run `coroutine`, then close this loop's client (for the sync wrappers' short-lived loops)."""
        try:
            return await coroutine
        finally:
            await self.aclose()


def _split(request: InferenceRequest, max_n: int) -> list[InferenceRequest]:
    """`request` as requests of at most `max_n` completions; the first keeps the seed, the others derive
    theirs."""
    parts = []
    for index, start in enumerate(range(0, request.n, max_n)):
        args = request.generation_args
        if index and args.seed is not None:
            args = args.model_copy(update={"seed": derive_seed(args.seed, "part", index)})
        parts.append(request.model_copy(update={"n": min(max_n, request.n - start), "generation_args": args}))
    return parts


def api_key_from_env(variable: str | None, field: str = "inference.api_key_env") -> str | None:
    """The bearer token held by the environment `variable` (None when none is named); `field`: the config
    field that names it."""
    if not variable:
        return None
    api_key = os.environ.get(variable)
    if not api_key:
        raise ConfigError(f"{field}: the environment variable {variable} is not set")
    return api_key


def normalise_base_url(base_url: str) -> str:
    """`base_url` as an API root ending in ``/v1``."""
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"base_url must start with http:// or https://, got {base_url!r}")
    return url if url.endswith("/v1") else f"{url}/v1"


def _request_body(request: InferenceRequest, model: str, prompt_ids: list[int] | None) -> dict[str, Any]:
    """The request in OpenAI's fields, plus the options that make llmrl, vLLM and SGLang return token ids;
    `prompt_ids`, when given, is the whole prompt, sent as a completions prompt of token ids."""
    args = request.generation_args
    body: dict[str, Any] = {
        "model": model,
        "n": request.n,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_tokens": args.max_tokens,
        "return_token_ids": True,
    }
    if prompt_ids is not None:
        body.update(prompt=prompt_ids, logprobs=1)
    elif isinstance(request.prompt, str):
        body.update(prompt=request.prompt, logprobs=1)  # SGLang returns no logprobs for logprobs=0
    else:
        body.update(
            messages=[m.model_dump() for m in request.prompt], logprobs=True, return_prompt_token_ids=True
        )
    if args.seed is not None:
        body["seed"] = args.seed
    # Extensions only when set, so that servers without them see a plain OpenAI request.
    extensions = {
        "stop": list(args.stop),
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty if args.repetition_penalty != 1.0 else None,
        "presence_penalty": args.presence_penalty,
        "min_tokens": args.min_tokens,
        "ignore_eos": args.ignore_eos,
        "chat_template_kwargs": args.chat_template_kwargs if "messages" in body else None,
        "stop_token_ids": list(args.stop_token_ids),
        "prompt_token_ids": request.prompt_token_ids if prompt_ids is None else None,
    }
    body.update({name: value for name, value in extensions.items() if value})
    return body


def _parse_responses(
    data: Any, request: InferenceRequest, chat: bool, version: int
) -> list[InferenceResponse]:
    """The `InferenceResponse` of each choice; `version` stands in for servers that report none."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or len(choices) != request.n:
        found = len(choices) if isinstance(choices, list) else "no"
        raise InferenceServerError(f"the server answered with {found} choices for n={request.n}")
    served = data.get("policy_version")  # llmrl's extension
    version = served if isinstance(served, int) else version
    responses = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
        if not prompt_ids:
            raise _missing("prompt_token_ids", "the prompt's token ids")
        prefix = request.prompt_token_ids
        if prefix is not None and prompt_ids[: len(prefix)] != prefix:
            raise UnsupportedServerError(
                "the server ignored prompt_token_ids (multi-turn continuation needs the llmrl server, or the "
                "model's tokenizer given to this client to send the prompt as token ids)"
            )
        responses.append(_parse_choice(choice, prompt_ids, chat, version))
    return responses


def _parse_choice(
    choice: dict[str, Any], prompt_ids: list[int], chat: bool, version: int
) -> InferenceResponse:
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise _missing("token_ids", "the completion's token ids")
    logprobs = choice.get("token_logprobs")
    if logprobs is None:
        logprobs = _openai_logprob_values(choice.get("logprobs") or {})
    if logprobs is None or len(logprobs) != len(token_ids) or any(v is None for v in logprobs):
        raise _missing("token_logprobs", "one logprob per completion token")
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    return InferenceResponse(
        text=text or "",
        prompt_token_ids=prompt_ids,
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=parse_finish_reason(choice.get("finish_reason")),
        policy_version=version,
        version_changes=choice.get("version_changes") or [],  # llmrl's server, with in-flight updates
    )


def _openai_logprob_values(logprobs: dict[str, Any]) -> list[float] | None:
    """Per-token logprobs from OpenAI's completions (``token_logprobs``) or chat (``content``) shape."""
    if isinstance(logprobs.get("token_logprobs"), list):
        return logprobs["token_logprobs"]
    if isinstance(logprobs.get("content"), list):
        return [entry.get("logprob") for entry in logprobs["content"]]
    return None


def _missing(field: str, what: str) -> UnsupportedServerError:
    return UnsupportedServerError(
        f"the server's response has no `{field}` ({what}), so it cannot be trained from. Use the llmrl "
        "inference server, vLLM >= 0.10.2 or SGLang (they return it when asked with return_token_ids and "
        "logprobs)"
    )
