"""What both HTTP servers share: bearer-token auth, bounded request bodies, 4xx errors that name the field.

Every route of an app built with `secure_app` requires ``Authorization: Bearer <token>`` when a token
is configured (``/healthz`` included: a health probe can send it too), refuses bodies larger than
``max_body_bytes`` with 413 before reading them, and answers invalid bodies with 422 and one line
per bad field (``body.n: Input should be less than or equal to 64``). A JSON body is checked before
any route sees it: it must be UTF-8, without NaN/Infinity (not JSON) and without lone surrogates
(``"\ud800"``, which no encoder can write back). Every error, unknown routes and methods included,
has the shape ``{"error": {"message", "type"}}``. Unexpected exceptions become a 500 with the
exception's type and message, answered on the same connection, which stays usable.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmrl.types import validation_problems

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
API_KEY_ENV = "LLMRL_API_KEY"
"""Environment variable read for the bearer token when ``--api-key`` is not given."""


def resolve_api_key(cli_value: str | None) -> str | None:
    """The token from ``--api-key``, else from `API_KEY_ENV`, else None (no auth)."""
    return cli_value or os.environ.get(API_KEY_ENV) or None


def error_response(status: int, message: str) -> JSONResponse:
    """The error body every route uses: ``{"error": {"message": ..., "type": ...}}`` (OpenAI's shape)."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        409: "conflict_error",
        413: "request_too_large",
        415: "invalid_request_error",
        422: "invalid_request_error",
    }.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


class _Guard:
    """ASGI middleware: checks the bearer token, the body's size and JSON before the route runs, and
    answers an exception the route raised with a 500 (the connection stays open for the next request)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, max_json_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_json_bytes = max_json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        refusal = self._refusal(headers)
        if refusal is None and _carries_json(scope, headers):
            try:
                body = await _read_body(_limited(receive, self.max_json_bytes))
            except BodyTooLarge as exc:
                refusal = error_response(413, str(exc))
            else:
                problem = _json_body_problem(body)
                refusal = None if problem is None else error_response(problem[0], problem[1])
                receive = _replay(body)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self._serve(scope, _limited(receive, self.max_body_bytes), send)

    def _refusal(self, headers: dict[str, str]) -> JSONResponse | None:
        if self.api_key is not None:
            given = headers.get("authorization", "")
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return error_response(401, "missing or wrong bearer token (Authorization: Bearer <key>)")
        length = headers.get("content-length")
        if length is not None and (
            not (length.isascii() and length.isdigit()) or int(length) > self.max_body_bytes
        ):
            return error_response(413, f"request body over the limit of {self.max_body_bytes} bytes")
        return None

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:  # half a response is out: only closing the connection can end it
                raise
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            await error_response(500, f"{type(exc).__name__}: {exc}")(scope, receive, send)


def _carries_json(scope: Scope, headers: dict[str, str]) -> bool:
    """Whether FastAPI would parse this request's body as JSON (a JSON or a missing content type)."""
    content_type = headers.get("content-type", "").partition(";")[0].strip().lower()
    json_type = content_type in ("", "application/json") or content_type.endswith("+json")
    return scope.get("method") in ("POST", "PUT", "PATCH") and json_type


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes) -> Receive:
    """A receive channel that gives `body` once, then waits for the client to disconnect."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    return replay


def _json_body_problem(body: bytes) -> tuple[int, str] | None:
    """(status, message) for a body no route can take as JSON text, or None.

    Not judged here: JSON syntax (FastAPI answers it with 422 and the position) and an empty body.
    """
    if not body:
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return 400, f"body: not valid UTF-8 (byte {exc.start})"
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except _NotJson as exc:
        return 422, f"body: {exc} is not a JSON value (numbers must be finite)"
    except RecursionError:
        return 422, "body: nested too deeply"
    except ValueError:
        return None
    return _surrogate_problem(value)


class _NotJson(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotJson(name)


def _surrogate_problem(value: Any) -> tuple[int, str] | None:
    """422 naming the first string (or key) holding a lone UTF-16 surrogate, which no UTF-8 can carry."""
    pending: list[tuple[str, Any]] = [("body", value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if not _encodable(key):
                    return 422, f"{where}: a key holds a lone surrogate (invalid Unicode)"
                pending.append((f"{where}.{key}", child))
        elif isinstance(item, list):
            pending.extend((f"{where}.{index}", child) for index, child in enumerate(item))
        elif isinstance(item, str) and not _encodable(item):
            return 422, f"{where}: holds a lone surrogate (invalid Unicode)"
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _limited(receive: Receive, limit: int) -> Receive:
    """A receive channel that fails once more than `limit` body bytes arrive (chunked uploads)."""
    seen = 0

    async def wrapped() -> dict[str, Any]:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return wrapped


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"request body over the limit of {limit} bytes")


def secure_app(
    app: FastAPI, *, api_key: str | None, max_body_bytes: int, max_json_bytes: int | None = None
) -> FastAPI:
    """Add auth, the body limits, the JSON check and uniform error responses to `app` (returns it).

    `max_json_bytes` bounds JSON bodies (default `max_body_bytes`), which are read whole to be checked.
    """

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, validation_problems(exc.errors()) or "invalid request")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404, 405, ...
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return error_response(413, str(exc))

    app.add_middleware(
        _Guard,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        max_json_bytes=max_json_bytes or max_body_bytes,
    )
    return app


def run_server(app: FastAPI, host: str, port: int) -> None:
    """Serve `app` with uvicorn until interrupted (one process, one event loop)."""
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: reachable from other machines; set an API key (--api-key)", host)
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
