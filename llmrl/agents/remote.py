"""An environment served by `llmrl serve-env` on another machine, used like a local agent.

```yaml
environments:
  - agent_type: remote
    env_id: arithmetic-remote
    agent_args: {url: http://10.0.0.7:8100, remote_env_id: arithmetic, api_key_env: ENV_SERVER_TOKEN}
```

The remote environment samples from the trainer's inference server, so the trainer must use an HTTP
interface (``inference.type: openai``): its `base_url` (or `inference_url`, the same server as the
environment machine reaches it) goes with every request.

Behaviour:

* **One remote environment.** A `RemoteAgent` targets `remote_env_id`; when that is not set, the
  server must serve exactly one environment (asked via ``GET /v1/info`` at first use).
* **Seeds and problem order** belong to the server's config (its `seed`, its environments' options);
  the `seed` passed in from the local run is accepted and ignored. `state_dict()` fetches the remote
  problem order (``GET /v1/state``) and `load_state_dict()` restores it, so a resumed run continues
  the remote order exactly.
* **Names.** Rollouts keep the remote environment's `env_id`, `problem_id` and group ids (they name
  the environment that produced them), so per-environment reward metrics use the remote name;
  evaluation results and this agent's counters use the local `env_id`, as every agent's do.
* **Failures.** Connection errors, timeouts and 5xx answers are retried `max_retries` times with
  exponential backoff (`backoff_s`, doubled each time). If the server stays unreachable,
  `group_rollouts` returns placeholder groups (left out of the loss) whose `failure_reason` says
  ``unreachable: remote environment server URL unreachable since TIME: CAUSE``, and counts
  ``failures/remote`` and ``placeholders``: a batch with too many stops the run as a dead inference
  server does (exit 75; the same command resumes, `llmrl.rollouts.checks`). A 4xx answer (a request the server refuses) raises at once
  with the server's message. A retry after a timeout may repeat a call the server finished, which
  skips that call's problems in the remote order.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from llmrl.agents.base import UNREACHABLE_FAILURE, Agent, Reachability, placeholder_rollout
from llmrl.config import ConfigError
from llmrl.http_client import RequestRefused, RetryPolicy, ServerUnavailable, send
from llmrl.inference.interface import InferenceInterface, run_blocking
from llmrl.types import (
    AgentStates,
    EvaluateRequest,
    EvaluateResponse,
    EvaluationResponse,
    GenerationArgs,
    GroupRolloutsRequest,
    GroupRolloutsResponse,
    InferenceEndpoint,
    RolloutGroup,
    ServerInfo,
    check_http_url,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
Answer = TypeVar("Answer", bound=BaseModel)

# A server that is down refuses connections at once; this bounds the wait for one that does not answer.
_CONNECT_TIMEOUT_S = 10.0


class RemoteError(RuntimeError):
    """The environment server refused a request (4xx) or sent an answer that does not fit."""


class RemoteUnavailableError(RemoteError):
    """The environment server gave no usable answer (connection error, timeout, 5xx) after all retries."""


class RemoteAgent(Agent):
    """The environment `remote_env_id` of the environment server at `url`."""

    def __init__(
        self,
        url: str,
        *,
        remote_env_id: str | None = None,
        env_id: str | None = None,
        api_key_env: str | None = None,
        inference_url: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        seed: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        """
        Args:
            url: base URL of the environment server, e.g. http://10.0.0.7:8100.
            remote_env_id: environment on the server (default: its only one).
            env_id: local name in metrics and evaluation results (default: `remote_env_id` or "remote").
            api_key_env: environment variable holding the server's bearer token.
            inference_url: the inference server's base URL as the environment server reaches it
                (default: the inference interface's own `base_url`).
            timeout_s: limit of one call (a whole step's rollouts are one call).
            max_retries: further attempts after a connection error, timeout or 5xx answer.
            backoff_s: wait before the first retry, doubled for each later one.
            seed: ignored; the server's config seeds its environments.
            transport: httpx transport (tests pass `httpx.ASGITransport(app)` or a mock).
        """
        del seed  # the remote's own config seeds it
        for name, value in (("url", url), ("inference_url", inference_url)):
            if value is not None:
                try:
                    check_http_url(value)
                except ValueError as exc:
                    raise ValueError(f"{name} {exc}") from None
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError(
                f"need timeout_s > 0, max_retries >= 0 and backoff_s >= 0, got {timeout_s}, {max_retries}, {backoff_s}"
            )
        headers = {}
        if api_key_env is not None:
            token = os.environ.get(api_key_env)
            if not token:
                raise ValueError(f"api_key_env: environment variable {api_key_env} is not set")
            headers["Authorization"] = f"Bearer {token}"
        self.url = url.rstrip("/")
        self.remote_env_id = remote_env_id
        self.env_id = env_id or remote_env_id or "remote"
        self.inference_url = inference_url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._headers = headers
        self._transport = transport
        self._counters: Counter[str] = Counter()
        self._remote_metrics: Counter[str] = Counter()
        self._failed_groups = 0
        self._reachability = Reachability()

    # ---- the Agent contract ----------------------------------------------------------------------

    async def group_rollouts(
        self,
        inference: InferenceInterface,
        num_groups: int,
        group_size: int,
        generation_args: GenerationArgs | None = None,
    ) -> list[RolloutGroup]:
        """The remote environment's groups, or placeholder groups when the server cannot be reached."""
        endpoint = self._endpoint(inference)
        if num_groups == 0:
            return []
        try:
            request = GroupRolloutsRequest(
                num_groups=num_groups,
                group_size=group_size,
                generation_args=generation_args,
                inference=endpoint,
                env_id=await self._target(),
            )
            reply = await self._call("POST", "/v1/group_rollouts", GroupRolloutsResponse, request)
        except RemoteUnavailableError as exc:
            down = self._reachability.down(f"remote environment server {self.url}", str(exc))
            return self._placeholder_groups(num_groups, group_size, f"{UNREACHABLE_FAILURE}: {down}")
        self._reachability.answered()
        shapes = [len(group.rollouts) for group in reply.groups]
        if shapes != [group_size] * num_groups:
            raise RemoteError(
                f"{self.url}: asked for {num_groups} groups of {group_size}, got sizes {shapes}"
            )
        self._remote_metrics.update(reply.metrics)
        return reply.groups

    async def evaluate(
        self,
        inference: InferenceInterface,
        num_prompts: int,
        *,
        samples_per_prompt: int = 1,
        greedy: bool = False,
        generation_args: GenerationArgs | None = None,
    ) -> EvaluationResponse:
        """The remote environment's held-out evaluation, reported under the local `env_id`."""
        endpoint = self._endpoint(inference)
        target = await self._target()
        request = EvaluateRequest(
            num_prompts=num_prompts,
            samples_per_prompt=samples_per_prompt,
            greedy=greedy,
            generation_args=generation_args,
            inference=endpoint,
            env_id=target,
        )
        reply = await self._call("POST", "/v1/evaluate", EvaluateResponse, request)
        if target not in reply.results:
            raise RemoteError(f"{self.url}: evaluation answer has no results for {target!r}")
        # pass@k settings are the caller's business (`PassAtKAgent` sets its own ks and threshold).
        return EvaluationResponse(env_id=self.env_id, results=reply.results[target])

    def check_problems(self) -> None:
        """Ask the server for its environments now: fails fast if it is unreachable or lacks ours."""
        run_blocking(self._with_context("reach", self._check_target(attempts=1)))

    def state_dict(self) -> dict[str, Any]:
        """The remote environment's problem order (raises `RemoteError` if the server cannot give it)."""

        async def fetch() -> dict[str, Any]:
            target = await self._target()
            states = await self._call("GET", "/v1/state", AgentStates)
            return {"remote_env_id": target, "state": states.state[target]}

        return run_blocking(self._with_context("save the state of", fetch()))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the remote environment's problem order saved by `state_dict()`."""

        async def restore() -> None:
            target = await self._target()
            if state.get("remote_env_id") != target or "state" not in state:
                raise ConfigError(
                    f"{self.env_id}: saved state is for remote environment {state.get('remote_env_id')!r}, "
                    f"this agent targets {target!r}"
                )
            await self._call("POST", "/v1/state", AgentStates, AgentStates(state={target: state["state"]}))

        run_blocking(self._with_context("restore the state of", restore()))

    def pop_metrics(self) -> dict[str, float]:
        """``failures/remote`` and ``placeholders`` of this agent, plus the server's own counters under
        ``remote/``."""
        metrics = {key: float(count) for key, count in self._counters.items()}
        metrics |= {f"remote/{key}": float(value) for key, value in self._remote_metrics.items()}
        self._counters.clear()
        self._remote_metrics.clear()
        return metrics

    # ---- HTTP ------------------------------------------------------------------------------------

    def _endpoint(self, inference: InferenceInterface) -> InferenceEndpoint:
        health = inference.health()
        base_url = self.inference_url or health.shared_url
        if base_url is None:
            raise ConfigError(
                "RemoteAgent needs an HTTP inference interface (inference.type: openai) "
                "so the remote environment can call it"
            )
        return InferenceEndpoint(base_url=base_url, model=health.model)

    async def _target(self) -> str:
        """The remote environment this agent draws from (the server's only one when not configured)."""
        return self.remote_env_id if self.remote_env_id is not None else await self._check_target()

    async def _check_target(self, *, attempts: int | None = None) -> str:
        """`remote_env_id`, checked against (or, when unset, taken from) the server's environments."""
        info = await self._call("GET", "/v1/info", ServerInfo, attempts=attempts)
        served = [env.env_id for env in info.environments]
        if self.remote_env_id is None:
            if len(served) != 1:
                raise ConfigError(
                    f"{self.env_id}: the environment server at {self.url} serves {served}; "
                    "set agent_args.remote_env_id to one of them"
                )
            self.remote_env_id = served[0]
        elif self.remote_env_id not in served:
            raise ConfigError(
                f"{self.env_id}: the environment server at {self.url} has no environment "
                f"{self.remote_env_id!r}; it serves {served}"
            )
        return self.remote_env_id

    async def _call(
        self,
        method: str,
        path: str,
        answer: type[Answer],
        body: BaseModel | None = None,
        *,
        attempts: int | None = None,
    ) -> Answer:
        """`method path` with `body`, retried with backoff while the server is unreachable or failing."""
        retries = self.max_retries if attempts is None else attempts - 1
        policy = RetryPolicy(
            self.timeout_s,
            retries=retries,
            backoff_s=self.backoff_s,
            connect_timeout_s=min(self.timeout_s, _CONNECT_TIMEOUT_S),
        )
        content = body.model_dump(mode="json") if body is not None else None
        try:
            async with httpx.AsyncClient(
                base_url=self.url, headers=self._headers, transport=self._transport
            ) as client:
                response = await send(client, method, path, policy, json=content)
        except RequestRefused as exc:
            raise RemoteError(str(exc)) from None
        except ServerUnavailable as exc:
            raise RemoteUnavailableError(str(exc)) from None
        try:
            return answer.model_validate_json(response.content)
        except ValidationError as exc:
            raise RemoteError(f"{method} {self.url}{path}: the answer does not fit: {exc}") from None

    async def _with_context(self, action: str, call: Coroutine[Any, Any, T]) -> T:
        try:
            return await call
        except RemoteError as exc:
            raise type(exc)(f"{self.env_id}: could not {action} the remote environment: {exc}") from exc

    def _placeholder_groups(self, num_groups: int, group_size: int, reason: str) -> list[RolloutGroup]:
        log.warning("%s: %s (%d group(s) replaced by placeholders)", self.env_id, reason, num_groups)
        self._counters["failures/remote"] += 1
        self._counters["placeholders"] += num_groups * group_size
        first, self._failed_groups = self._failed_groups, self._failed_groups + num_groups
        return [
            RolloutGroup(
                group_id=f"{self.env_id}/remote-failed-{k}",
                rollouts=[
                    placeholder_rollout(self.env_id, "unavailable", reason[:500]) for _ in range(group_size)
                ],
            )
            for k in range(first, first + num_groups)
        ]
