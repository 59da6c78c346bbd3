"""OpenEnv environments (the `openenv` extra): train against an environment server, as TRL does.

An OpenEnv environment is a server (FastAPI, `openenv.core.create_app`) with a WebSocket session per
client: ``reset(seed=...)`` gives the first observation, ``step(action)`` the next observation, its
reward and ``done``. The environment is the server at ``url:`` (started by the user), or the ASGI app
(or app factory) of a plug-in module that llmrl serves itself with uvicorn on a free local port
(``serve: {module: my_env:app}``), never a container.

Two functions glue the model to the environment, as in TRL: ``observation_to_messages(observation)``
gives what the model reads (a string, a message dict, or a list of them) and
``completion_to_action(completion)`` the action its reply stands for. Without them the agent reads
the environment's schema (``/schema``): an observation with a single text field is shown as a user
message, and a reply becomes an action whose single text field holds the completion.

A problem is one reset seed: `num_problems` training seeds drawn from the run's seed, and `eval_size`
held-out seeds that do not depend on it (so runs of any seed evaluate on the same episodes). A
problem's `group_size` episodes each open their own session, reset with the problem's seed. An episode
runs reset -> messages -> model turn -> action -> step -> ... until the environment says ``done`` or
after `max_turns` model turns; its reward is the sum of its steps' rewards (a step without one counts
0). All turns form one token sequence, continued at the token level as the multi-turn reward-only
agents continue theirs (`llmrl.agents.reward_only`): only the model's tokens are trained on.

Failures make the episode a placeholder, counted in ``failures/<stage>``: ``unreachable`` (the server
did not answer: a refused or lost connection, no answer within `step_timeout_s`, a 5xx; the line names
the server's URL, since when it has not answered, and why), ``environment`` (the server answered with
an error, as when the environment raised on this episode, or with a reward that is not a number),
``observe`` (one of the user's two functions raised or returned something unusable: the line names
its file and line), ``inference`` and ``data`` as for every agent. An ``unreachable`` episode says more
about the server than about the policy: a batch with too many of them is refused as one that failed in
inference is, and the run stops with `EnvironmentUnavailableError` (the CLI exits with 75) so that
rerunning the same command once the server answers resumes from the last checkpoint
(`llmrl.rollouts.checks`). A server that does not answer when the run starts stops it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import sys
import tempfile
import threading
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from llmrl.agents.base import (
    DATA_FAILURE,
    UNREACHABLE_FAILURE,
    Problem,
    Reachability,
    placeholder_rollout,
    prompt_text,
    request_args,
)
from llmrl.agents.reward_only import ProblemSetAgent
from llmrl.agents.trajectory import Trajectory
from llmrl.errors import EnvironmentUnavailableError, UserCodeFailure, UserError, code_location
from llmrl.inference.interface import InferenceInterface, RequestRejected
from llmrl.processes import ServerProcess, free_port
from llmrl.registry import resolve_function
from llmrl.seeding import derive_seed
from llmrl.telemetry import trace_span
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest, InferenceResponse, TokenRollout

MISSING_EXTRA = "agent_type openenv needs the openenv extra: pip install 'llmrl[openenv]'"

# OpenEnv's reset request takes a seed >= 0; many environments hand it to numpy (below 2**32).
_SEED_RANGE = 2**31

# Fields every OpenEnv observation or action has besides its own: not what the model reads or writes.
_BOOKKEEPING_FIELDS = {"done", "reward", "metadata"}

_SERVE_FIELDS = {"module", "startup_timeout_s"}

Messages = str | list[ChatMessage]


def _import_openenv() -> Any:
    try:
        from openenv.core import env_client, generic_client
    except ImportError:
        raise UserError(MISSING_EXTRA) from None
    return env_client.EnvClient, generic_client.GenericEnvClient


class OpenEnvAgent(ProblemSetAgent):
    """Episodes played against an OpenEnv environment server; the reward is the sum of its step rewards."""

    def __init__(
        self,
        *,
        url: str | None = None,
        serve: Mapping[str, Any] | None = None,
        client: str | type | None = None,
        observation_to_messages: str | Callable[[Any], Any] | None = None,
        completion_to_action: str | Callable[[str], Any] | None = None,
        system_prompt: str | None = None,
        chat: bool = True,
        max_turns: int = 8,
        num_problems: int = 1024,
        max_sessions: int = 1,
        step_timeout_s: float = 60.0,
        **kwargs: Any,
    ):
        """
        Args:
            url: the environment server, already running (``http://host:port``).
            serve: instead of `url`, the server llmrl starts: ``{module: MODULE:APP}``, the FastAPI app
                (or a function that makes it) of a `plugins:` module; ``startup_timeout_s`` (default 60).
            client: the environment's `EnvClient` class as ``module:Class`` of a plug-in (default:
                OpenEnv's `GenericEnvClient`, whose observations are dicts and which sends dict actions).
            observation_to_messages: ``module:function`` of a plug-in: an observation -> the model's next
                message(s) (a string, ``{role, content}`` or a list of them); default: the observation's
                only text field.
            completion_to_action: ``module:function``: the model's reply (a string) -> the action to
                step with; default: an action whose only text field holds the reply.
            system_prompt: a system message before the first observation (None: none).
            chat: chat messages (for chat-tuned models), else plain text.
            max_turns: most model turns per episode.
            num_problems: training reset seeds.
            max_sessions: episodes in flight at once, each holding a session of the server (OpenEnv's
                servers allow one unless made with `max_concurrent_envs`).
            step_timeout_s: limit of one reset or step of the server.
            **kwargs: `ProblemSetAgent` options (eval_size: held-out seeds, inference_timeout_s,
                generation_args).
        """
        env_client_class, generic_client_class = _import_openenv()
        if (url is None) == (serve is None):
            raise ValueError("give either url (a running environment server) or serve (one llmrl starts)")
        if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"url: expected http://host:port, got {url!r}")
        for field, value in (("max_turns", max_turns), ("num_problems", num_problems)):
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
        super().__init__(**kwargs)
        self.client_class = _resolve(client, "client") if client is not None else generic_client_class
        if not (isinstance(self.client_class, type) and issubclass(self.client_class, env_client_class)):
            raise ValueError(f"client: {client!r} is not an OpenEnv EnvClient class")
        self.observation_to_messages = _resolve(observation_to_messages, "observation_to_messages")
        self.completion_to_action = _resolve(completion_to_action, "completion_to_action")
        self.system_prompt = system_prompt
        self.chat = chat
        self.max_turns = max_turns
        self.num_problems = num_problems
        self.max_sessions = max_sessions
        self.step_timeout_s = step_timeout_s
        self.url = url.rstrip("/") if url is not None else None
        self._server = _ServedEnvironment(self.env_id, serve) if serve is not None else None
        self._connecting = threading.Lock()
        self._connected = False
        self._reachability = Reachability()
        self._sessions: asyncio.Semaphore | None = None
        self._sessions_loop: asyncio.AbstractEventLoop | None = None

    # ---- problems: reset seeds ----------------------------------------------------------------------

    def prompts(self) -> list[Problem]:
        held_out = {problem.id for problem in self.eval_prompts()}
        seeds = (
            derive_seed(self.seed, "openenv", "train", i) % _SEED_RANGE for i in range(self.num_problems)
        )
        return [problem for problem in map(_seed_problem, seeds) if problem.id not in held_out]

    def eval_prompts(self) -> list[Problem]:
        # A fixed key rather than the run's seed: runs of any seed evaluate on the same episodes.
        return [
            _seed_problem(derive_seed(0, "openenv", "held-out", i) % _SEED_RANGE)
            for i in range(self.eval_size)
        ]

    # ---- the server ---------------------------------------------------------------------------------

    def check_problems(self) -> None:
        super().check_problems()
        self.connect()

    def connect(self) -> None:
        """Start the server (`serve`) or check that it answers (`url`), and read its schema for the
        default functions; once. A server that does not answer raises `EnvironmentUnavailableError`
        (the same command may succeed later), one that answers with something else a `UserError`."""
        try:
            self._connect()
        except _ServerDown as down:
            raise EnvironmentUnavailableError(
                f"{self.env_id}: {down}; rerun the same command once it answers"
            ) from None

    def _connect(self) -> None:
        with self._connecting:
            if self._connected:
                return
            if self._server is not None:
                self.url = self._server.start()
            try:
                response = httpx.get(f"{self.url}/schema", timeout=self.step_timeout_s)
                response.raise_for_status()
                schema = response.json()
            except (httpx.HTTPError, ValueError) as exc:
                if _unreachable(exc):
                    raise _ServerDown(self._down_since(exc)) from exc
                raise UserError(f"{self.env_id}: {_server_problem(self.url, exc)}") from None
            self._reachability.answered()
            if self.observation_to_messages is None:
                field = self._text_field(schema, "observation", "observation_to_messages")
                self.observation_to_messages = _FieldReader(field)
            if self.completion_to_action is None:
                field = self._text_field(schema, "action", "completion_to_action")
                self.completion_to_action = _ActionWriter(field, _action_class(self.client_class))
            self._connected = True

    def _text_field(self, schema: Mapping[str, Any], part: str, function_field: str) -> str:
        properties = (schema.get(part) or {}).get("properties") or {}
        fields = [name for name in properties if name not in _BOOKKEEPING_FIELDS]
        text = [name for name in fields if properties[name].get("type") == "string"]
        if len(text) != 1:
            raise UserError(
                f"{self.env_id}: {function_field}: the {part}s of the environment at {self.url} have "
                f"{'no' if not text else 'more than one'} text field (fields: {', '.join(fields) or 'none'}); "
                f"name a plug-in function that makes the {'messages' if part == 'observation' else 'action'}"
            )
        return text[0]

    # ---- episodes -----------------------------------------------------------------------------------

    async def run_episodes(
        self, inference: InferenceInterface, problem: Problem, n: int, args: GenerationArgs
    ) -> list[TokenRollout]:
        """`n` episodes of `problem`'s seed, each in its own session; failures become placeholders."""
        reason = None
        try:
            if not self._connected:
                await asyncio.to_thread(self._connect)
        except _ServerDown as down:
            reason = f"{UNREACHABLE_FAILURE}: {down}"[:500]
        except Exception as exc:  # noqa: BLE001 - a server that cannot start fails its episodes, counted
            reason = " ".join(f"environment: {str(exc).removeprefix(f'{self.env_id}: ')}".split())[:500]
        if reason is not None:
            self._count_failure(reason.split(":", 1)[0], reason, count=n)
            return [placeholder_rollout(self.env_id, problem.id, reason) for _ in range(n)]
        episodes = (self._episode(inference, problem, request_args(args, "sample", i)) for i in range(n))
        return list(await asyncio.gather(*episodes))

    async def _episode(
        self, inference: InferenceInterface, problem: Problem, args: GenerationArgs
    ) -> TokenRollout:
        trajectory = Trajectory(args)
        total = 0.0
        stage = "environment"
        async with self._session_slots():
            client = self.client_class(base_url=self.url, message_timeout_s=self.step_timeout_s)
            try:
                with trace_span("reset", env=self.env_id):
                    result = await client.reset(seed=problem.answer)
                self._reachability.answered()
                for turn in range(self.max_turns):
                    stage = "observe"
                    messages = self._messages(result.observation, first=turn == 0)
                    stage = "inference"
                    response = await self._model_turn(
                        inference, trajectory, messages, request_args(args, "turn", turn)
                    )
                    stage = "observe"
                    action = self._call_user(self.completion_to_action, response.text)
                    stage = "environment"
                    with trace_span("step", env=self.env_id):
                        result = await client.step(action)
                    self._reachability.answered()
                    total += _step_reward(result.reward)
                    if result.done:
                        break
            except Exception as exc:  # noqa: BLE001 - a failure fails this episode only
                reason = self._failure_reason(stage, exc, problem)
                self._count_failure(reason.split(":", 1)[0], reason, count=1)
                return placeholder_rollout(self.env_id, problem.id, reason)
            finally:
                with contextlib.suppress(Exception):
                    await client.close()
        return trajectory.rollout(self.env_id, problem.id, total)

    async def _model_turn(
        self, inference: InferenceInterface, trajectory: Trajectory, messages: Messages, args: GenerationArgs
    ) -> InferenceResponse:
        """Sample the model's reply to `messages` after the episode's tokens so far, and add both."""
        prefix = list(trajectory.tokens)
        request = InferenceRequest(
            prompt=messages, prompt_token_ids=prefix or None, generation_args=args, n=1
        )
        with trace_span("generate", env=self.env_id, n=1):
            (response,) = await asyncio.wait_for(inference.agenerate(request), self.inference_timeout_s)
        if response.prompt_token_ids[: len(prefix)] != prefix:
            raise RuntimeError(
                "the inference engine did not continue from prompt_token_ids (earlier turns changed)"
            )
        trajectory.add_context(response.prompt_token_ids[len(prefix) :], prompt_text(messages))
        trajectory.add_completion(response)
        return response

    def _messages(self, observation: Any, *, first: bool) -> Messages:
        """What the model reads of `observation`: the first turn's prompt, or the next turn's messages."""
        made = self._call_user(self.observation_to_messages, observation)
        function = self.observation_to_messages
        if self.chat:
            messages = _chat_messages(made, function)
            system = (
                [ChatMessage(role="system", content=self.system_prompt)]
                if first and self.system_prompt
                else []
            )
            return [*system, *messages]
        if not isinstance(made, str) or not made:
            raise UserCodeFailure.returned(
                code_location(None, function), made, "a non-empty string (chat: false)"
            )
        return f"{self.system_prompt}\n\n{made}" if first and self.system_prompt else made

    def _call_user(self, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except Exception as exc:
            raise UserCodeFailure(code_location(exc, function), f"{type(exc).__name__}: {exc}") from exc

    def _failure_reason(self, stage: str, exc: BaseException, problem: Problem) -> str:
        if stage == "inference" and isinstance(exc, RequestRejected):
            return f"{DATA_FAILURE}: problem {problem.id}: {exc}"[:500]
        if stage == "inference" and isinstance(exc, TimeoutError):
            return f"inference: timed out after {self.inference_timeout_s} s"
        if stage == "environment":
            if _unreachable(exc):
                return f"{UNREACHABLE_FAILURE}: {self._down_since(exc)}"[:500]
            return f"environment: {_server_problem(self.url, exc)}"[:500]
        if isinstance(exc, UserCodeFailure):
            return f"{stage}: {exc}"[:500]
        return f"{stage}: {_one_line(exc)}"[:500]

    def _down_since(self, exc: BaseException) -> str:
        """``openenv server URL unreachable since TIME: CAUSE``: the server did not answer (`exc`)."""
        cause = (
            f"no answer within step_timeout_s={self.step_timeout_s:g} s"
            if isinstance(exc, TimeoutError)
            else _one_line(exc)
        )
        return self._reachability.down(f"openenv server {self.url}", cause)

    def _session_slots(self) -> asyncio.Semaphore:
        # A semaphore belongs to one event loop; the sync entry points start a new loop per call.
        loop = asyncio.get_running_loop()
        if self._sessions is None or self._sessions_loop is not loop:
            self._sessions, self._sessions_loop = asyncio.Semaphore(self.max_sessions), loop
        return self._sessions


class _ServerDown(Exception):
    """The environment server did not answer; the message says which, since when and why."""


def _unreachable(exc: BaseException) -> bool:
    """Whether `exc` says that the environment server did not answer (a refused, failed or lost
    connection, no answer in time, a 5xx) rather than that it answered with an error of its own (the
    environment raised on this episode, a session refused, a 4xx: a rerun would meet it again)."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus  # openenv's client runs on websockets

    for error in _chain(exc):
        # A handshake or request the server (or a proxy in front of it) answered with an HTTP status.
        if isinstance(error, InvalidStatus):
            return error.response.status_code >= 500
        if isinstance(error, httpx.HTTPStatusError):
            return error.response.status_code >= 500
    # OpenEnv's client raises ConnectionError (an OSError) for any connection that cannot be opened.
    return isinstance(exc, OSError | TimeoutError | ConnectionClosed | httpx.TransportError)


def _chain(exc: BaseException) -> typing.Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


class _ServedEnvironment:
    """The environment server llmrl runs for `serve:`: uvicorn on a plug-in's app, on a free local port."""

    def __init__(self, env_id: str, serve: Mapping[str, Any]):
        if not isinstance(serve, Mapping) or "module" not in serve or set(serve) - _SERVE_FIELDS:
            raise ValueError(f"serve: expected {{module: MODULE:APP, startup_timeout_s: S}}, got {serve!r}")
        app = serve["module"]
        target = _resolve(app, "serve.module")
        self.env_id = env_id
        self.app = app
        # uvicorn calls a factory for the app; an app object is served as it is.
        self.factory = inspect.isfunction(target)
        self.import_path = _import_folder(app.rpartition(":")[0])
        self.startup_timeout_s = float(serve.get("startup_timeout_s", 60.0))
        if self.startup_timeout_s <= 0:
            raise ValueError(f"serve.startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        self.process: _UvicornProcess | None = None

    def start(self) -> str:
        """Start the server (once) and return its URL; a `UserError` with its log's end if it cannot."""
        if self.process is None:
            port = free_port()
            self.process = _UvicornProcess(self, port)
            try:
                self.process.start()
            except RuntimeError as exc:
                raise UserError(f"{self.env_id}: serve.module {self.app}: {exc}") from None
        return self.process.root_url


class _UvicornProcess(ServerProcess):
    def __init__(self, served: _ServedEnvironment, port: int):
        log = Path(tempfile.gettempdir()) / f"llmrl-openenv-{os.getpid()}-{port}.log"
        super().__init__(
            name=f"the OpenEnv server of {served.app}",
            host="127.0.0.1",
            port=port,
            log_path=log,
            health_route="/health",
            startup_timeout_s=served.startup_timeout_s,
            timeout_field="serve.startup_timeout_s",
        )
        self.served = served

    def command(self) -> list[str]:
        factory = ["--factory"] if self.served.factory else []
        return [
            *(sys.executable, "-m", "uvicorn", self.served.app, *factory),
            *("--host", self.host, "--port", str(self.port), "--log-level", "warning"),
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.served.import_path is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, (self.served.import_path, env.get("PYTHONPATH")))
            )
        return env


class _FieldReader:
    """The default `observation_to_messages`: the observation's only text field, as the user's message."""

    def __init__(self, field: str):
        self.field = field

    def __call__(self, observation: Any) -> str:
        return (
            observation[self.field] if isinstance(observation, Mapping) else getattr(observation, self.field)
        )


class _ActionWriter:
    """The default `completion_to_action`: an action whose only text field holds the completion (a dict
    for the generic client, else the client's action class)."""

    def __init__(self, field: str, action_class: type | None):
        self.field = field
        self.action_class = action_class

    def __call__(self, completion: str) -> Any:
        fields = {self.field: completion}
        return self.action_class(**fields) if self.action_class is not None else fields


def _seed_problem(seed: int) -> Problem:
    return Problem(id=f"seed-{seed}", prompt=f"reset(seed={seed})", answer=seed)


def _resolve(spec: str | Callable[..., Any] | None, field: str) -> Any:
    """A plug-in's function or class named ``module:name``; from Python, the object itself."""
    if spec is None or callable(spec):
        return spec
    try:
        return resolve_function(spec)
    except UserError as exc:
        raise ValueError(f"{field}: {exc}") from None


def _import_folder(module: str) -> str | None:
    """The folder the server's process must import `module`'s top package from: plug-ins may be files
    outside the import path (``plugins: [examples/my_env.py]``)."""
    top = sys.modules.get(module.partition(".")[0])
    file = getattr(top, "__file__", None)
    if file is None:
        return None
    path = Path(file).resolve()
    return str(path.parent.parent if path.name == "__init__.py" else path.parent)


def _action_class(client_class: type) -> type | None:
    """The action type a typed client is declared with (``EnvClient[MyAction, ...]``); None for the
    generic client, which sends dicts."""
    for klass in client_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            arguments = typing.get_args(base)
            if arguments and isinstance(arguments[0], type) and hasattr(arguments[0], "model_fields"):
                return arguments[0]
    return None


def _chat_messages(made: Any, function: Callable[..., Any]) -> list[ChatMessage]:
    """The user's function's result as chat messages: a string is one user message."""
    items = [made] if isinstance(made, str | Mapping | ChatMessage) else made
    try:
        messages = [
            item
            if isinstance(item, ChatMessage)
            else ChatMessage(role="user", content=item)
            if isinstance(item, str)
            else ChatMessage.model_validate({"role": "user", **item})
            for item in items
        ]
    except Exception:  # noqa: BLE001 - anything that is not messages is the function's mistake
        messages = []
    if not messages:
        raise UserCodeFailure.returned(
            code_location(None, function), made, "a string, a {role, content} message or a list of them"
        )
    return messages


def _step_reward(reward: Any) -> float:
    """A step's reward as a number: OpenEnv allows none (0 here) and booleans (0 or 1)."""
    if reward is None:
        return 0.0
    if not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(f"a step's reward {reward!r} is not a finite number")
    return float(reward)


def _server_problem(url: str | None, exc: BaseException) -> str:
    return f"openenv server {url}: {_one_line(exc)}"


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())
