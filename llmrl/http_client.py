"""llmrl's one HTTP client layer: every call under a timeout, retried with backoff, failures typed.

The OpenAI-compatible client, the remote agent and the vLLM integration send their requests with
`send`. An attempt is bounded end to end by `RetryPolicy.timeout_s` (and its connect phase by
`connect_timeout_s`); connection errors, timeouts, 408, 429 and 5xx answers are retried
`retries` times, ``backoff_s * 2**(attempt - 1)`` apart, with a log line each; any other 4xx is
the server refusing, raised at once as `RequestRefused` (retrying would get the same answer).
What is left after the last attempt is `ServerUnavailable`. Both carry the last HTTP status
(None when the server never answered) and the server's own message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)

RETRYABLE_STATUSES = frozenset({408, 429})
"""4xx answers worth retrying (the server is busy or timed out); every 5xx is retried too."""


class HTTPRequestError(RuntimeError):
    """A request that got no usable answer.

    `status` is the server's last HTTP status (None when it never answered); `failure` says what
    went wrong (``HTTP 503: busy``, ``ConnectError: ...``); `detail` is the server's own message.
    """

    def __init__(self, message: str, *, status: int | None, failure: str, detail: str = ""):
        super().__init__(message)
        self.status = status
        self.failure = failure
        self.detail = detail


class RequestRefused(HTTPRequestError):
    """The server answered 4xx (other than 408/429): the request itself is wrong."""


class ServerUnavailable(HTTPRequestError):
    """No usable answer after every attempt: connection errors, timeouts, 408/429 or 5xx."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long one attempt may take and how often a retryable failure is tried again."""

    timeout_s: float
    retries: int = 0
    backoff_s: float = 0.5
    connect_timeout_s: float | None = None
    """Bound on connecting (a server that is down but does not refuse); default: `timeout_s`."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or self.retries < 0 or self.backoff_s < 0:
            raise ValueError(
                f"need timeout_s > 0, retries >= 0 and backoff_s >= 0, got "
                f"{self.timeout_s}, {self.retries} and {self.backoff_s}"
            )


def is_retryable(status: int) -> bool:
    return status >= 500 or status in RETRYABLE_STATUSES


async def send(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    policy: RetryPolicy,
    *,
    on_answer: Callable[[int | None], None] | None = None,
    **kwargs: Any,
) -> httpx.Response:
    """`method path` on `client` under `policy`: the first answer below 400, else a typed error.

    `on_answer(status)` is told of every attempt's outcome (None: no answer), e.g. to track since
    when a server has been unreachable. `kwargs` go to `httpx.AsyncClient.request` (json, content).
    """
    url = f"{str(client.base_url).rstrip('/')}{path}"
    timeout = httpx.Timeout(policy.timeout_s, connect=policy.connect_timeout_s or policy.timeout_s)
    failure, detail, status = "", "", None
    for attempt in range(policy.retries + 1):
        if attempt:
            delay = policy.backoff_s * 2 ** (attempt - 1)
            log.warning("%s %s: %s; retrying in %.1f s", method, url, failure, delay)
            await asyncio.sleep(delay)
        try:
            # wait_for bounds the whole attempt: httpx's timeouts bound each read, not their sum.
            response = await asyncio.wait_for(
                client.request(method, path, timeout=timeout, **kwargs), policy.timeout_s
            )
        except (TimeoutError, httpx.TransportError) as exc:
            failure, detail, status = f"{type(exc).__name__}: {exc}".rstrip(": "), "", None
            if on_answer is not None:
                on_answer(None)
            continue
        status = response.status_code
        if on_answer is not None:
            on_answer(status)
        if status < 400:
            return response
        detail = error_message(response)
        failure = f"HTTP {status}: {detail}"
        if not is_retryable(status):
            raise RequestRefused(f"{method} {url}: {failure}", status=status, failure=failure, detail=detail)
    raise ServerUnavailable(
        f"{method} {url}: no answer after {policy.retries + 1} attempt(s): {failure}",
        status=status,
        failure=failure,
        detail=detail,
    )


def error_message(response: httpx.Response) -> str:
    """The server's message: OpenAI's ``{"error": {"message"}}``, vLLM's ``{"message"}`` or ``{"detail"}``."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in data:
                return str(data[key])
    return str(data)[:500]
