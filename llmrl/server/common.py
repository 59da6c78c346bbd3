"""What both HTTP servers share: bearer-token auth, bounded request bodies, 4xx errors that name the field.

Every route of an app built with `secure_app` requires ``Authorization: Bearer <token>`` when a token
is configured (``/healthz`` included: a health probe can send it too), refuses bodies larger than
``max_body_bytes`` with 413 before reading them, and answers invalid bodies with 422 and one line
per bad field (``body.n: Input should be less than or equal to 64``). Unexpected exceptions become a
500 with the exception's type and message; the server keeps serving.
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
API_KEY_ENV = "LLMRL_API_KEY"
"""Environment variable read for the bearer token when ``--api-key`` is not given."""


def resolve_api_key(cli_value: str | None) -> str | None:
    """The token from ``--api-key``, else from `API_KEY_ENV`, else None (no auth)."""
    return cli_value or os.environ.get(API_KEY_ENV) or None


def error_response(status: int, message: str) -> JSONResponse:
    """The error body every route uses: ``{"error": {"message": ..., "type": ...}}`` (OpenAI's shape)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            409: "conflict_error", 413: "request_too_large", 422: "invalid_request_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def _field(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc)


class _Guard:
    """ASGI middleware: checks the bearer token and the declared body size before the route runs."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        if self.api_key is not None:
            given = headers.get("authorization", "")
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                await error_response(401, "missing or wrong bearer token (Authorization: Bearer <key>)")(
                    scope, receive, send
                )
                return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await error_response(413, f"request body over the limit of {self.max_body_bytes} bytes")(
                scope, receive, send
            )
            return
        await self.app(scope, _limited(receive, self.max_body_bytes), send)


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


def secure_app(app: FastAPI, *, api_key: str | None, max_body_bytes: int) -> FastAPI:
    """Add auth, the body limit and uniform error responses to `app` (returns it)."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        lines = [f"{_field(e['loc'])}: {e['msg']}" for e in exc.errors()]
        return error_response(422, "; ".join(lines) or "invalid request")

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return error_response(413, str(exc))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"{type(exc).__name__}: {exc}")

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


def run_server(app: FastAPI, host: str, port: int) -> None:
    """Serve `app` with uvicorn until interrupted (one process, one event loop)."""
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: reachable from other machines; set an API key (--api-key)", host)
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
