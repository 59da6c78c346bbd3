"""The OpenAI-compatible endpoint of one agent-program episode, and the token sequences it records.

Each episode of an `openai_agent` environment gets an `openai.AsyncOpenAI` client whose HTTP
transport is an `EpisodeTransport`: requests never leave the process, whatever the base URL says,
and only ``POST /v1/chat/completions`` and ``GET /v1/models`` answer. A transport rather than a
server on a port: nothing else can reach the endpoint, the episode owning it is known without a
key or a session header, it runs on the event loop that drives the inference interface (the
embedded engine batches every episode's calls together), and no port is opened per episode.

A chat call is rendered here with the model's chat template (``tools`` included) into prompt ids,
sent to the inference interface as exactly those ids (`InferenceRequest.prompt_token_ids` with an
empty prompt), and answered in OpenAI's shape, with ``tool_calls`` parsed from the text by the
configured parser (`llmrl.agents.tool_parsers`). Every call's prompt ids, completion ids, sampled
logprobs and weight version are recorded, and become training sequences:

* a call whose prompt starts with all the tokens of an open sequence, sampled with the same
  distribution options, extends it: the tokens in between (tool results, user turns, the template's
  markup) are added masked out of the loss, the completion masked in;
* any other call starts a new sequence of the episode, its whole prompt masked out. Every sequence
  of an episode gets the episode's reward, so the same advantage. A sampled completion is trained
  once, in the sequence it was sampled in.

Completions are put back token for token. When a call's messages repeat an earlier call's
messages and the assistant message it answered with, the prompt is that call's prompt ids and the
completion's sampled ids, followed by the remaining messages rendered as a follow-up turn
(`llmrl.inference.prompts.follow_up_ids`), not the template's re-rendering of the whole
conversation. Re-tokenising sampled text does not always give back the sampled ids (BPE merges
across the boundary, stripped whitespace, a template that rewrites earlier turns), and a
conversation re-rendered differently would both cut the episode into unrelated sequences and ask
the model to continue text it did not write. With the ids put back, the model is sent exactly what
it wrote, every turn extends the sequence, and what is trained is what was sampled. A program that
edits an earlier reply gets its edit: the messages no longer repeat the reply, and the template
renders them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from pydantic import ValidationError

from llmrl.agents.base import request_args
from llmrl.agents.tool_parsers import ParsedCompletion
from llmrl.agents.trajectory import Trajectory
from llmrl.inference.interface import InferenceInterface
from llmrl.inference.openai import UnsupportedServerError
from llmrl.inference.prompts import follow_up_ids
from llmrl.types import (
    ChatBody,
    GenerationArgs,
    InferenceRequest,
    InferenceResponse,
    OpenAIMessage,
    TokenRollout,
    validation_problems,
)

MODEL_NAME = "llmrl-policy"
"""The model id the endpoint lists; requests may name any model, they all reach the policy."""

# OpenAI fields the endpoint cannot honour; a request may send them only with a neutral value.
_UNSUPPORTED = {
    "stream": False,
    "echo": False,
    "best_of": 1,
    "suffix": None,
    "logit_bias": None,
    "frequency_penalty": 0,
    "functions": None,
    "response_format": {"type": "text"},
}
_DISTRIBUTION_OPTIONS = ("temperature", "top_p", "top_k", "min_p")
"""What the trainer's logprobs of a sequence follow: a sequence's calls must agree on them."""


FailureStage = Literal["program", "reward", "limit", "inference"]
"""Where an episode failed; its placeholders are counted under ``failures/<stage>``."""


@dataclass(frozen=True)
class EpisodeFailure:
    """Why an episode cannot be trained on: the stage that failed, and what went wrong there."""

    stage: FailureStage
    detail: str

    @property
    def reason(self) -> str:
        """The placeholder's `failure_reason`, as logged: the stage, then the detail (the trainer tells
        inference failures and the user's code failing apart by it: `llmrl.agents.base.failed_in_inference`,
        `failed_in_user_code`)."""
        return f"{self.stage}: {self.detail}"[:500]


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class ProgramClock:
    """Seconds an episode's program has run on its own: the time its model calls spent waiting for
    generation is left out (`timeout_s` bounds the program, not the queue in front of the model, which
    grows with the number of episodes running; the calls have `inference_timeout_s`)."""

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._calls_waiting = 0
        self._waiting_since = 0.0
        self._waited = 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a model call: its time does not count (calls made together count once)."""
        if self._calls_waiting == 0:
            self._waiting_since = time.monotonic()
        self._calls_waiting += 1
        try:
            yield
        finally:
            self._calls_waiting -= 1
            if self._calls_waiting == 0:
                self._waited += time.monotonic() - self._waiting_since

    def seconds(self) -> float:
        now = time.monotonic()
        waiting = now - self._waiting_since if self._calls_waiting else 0.0
        return now - self._started - self._waited - waiting

    async def run(self, program: Awaitable[Any], timeout_s: float | None) -> Any:
        """Await `program`; past `timeout_s` seconds of its own (`seconds`), cancel it and raise TimeoutError."""
        task = asyncio.ensure_future(program)
        try:
            while timeout_s is not None:
                left = timeout_s - self.seconds()
                if left <= 0:
                    raise TimeoutError
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    break
            return await task
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


@dataclass(frozen=True)
class EpisodeLimits:
    max_calls: int | None = None
    """Most chat calls of an episode (None: no limit)."""
    max_tokens: int | None = None
    """Most tokens the episode's training sequences may hold together (None: no limit)."""


@dataclass
class _Call:
    """A recorded chat call: its messages (as `_message_key`s), prompt, and each choice's reply."""

    messages: list[tuple]
    prompt_ids: list[int]
    responses: list[InferenceResponse]
    replies: list[tuple]


class Episode:
    """The recorder behind one episode's endpoint: renders, generates, answers, and keeps sequences."""

    def __init__(
        self,
        inference: InferenceInterface,
        tokenizer: Any,
        *,
        args: GenerationArgs,
        training: bool,
        tool_parser: Callable[[str], ParsedCompletion] | None,
        limits: EpisodeLimits,
        timeout_s: float | None,
    ):
        """
        Args:
            inference: where completions are sampled.
            tokenizer: the model's tokenizer, with its chat template.
            args: sampling options of calls that set none (the run's, with the environment's over them).
            training: refuse options the trainer cannot reproduce (penalties, `min_tokens`, greedy).
            tool_parser: how tool calls are read from completions; None refuses requests with ``tools``.
            limits: the episode's call and token limits.
            timeout_s: limit of one inference request.
        """
        self.inference = inference
        self.tokenizer = tokenizer
        self.args = args
        self.training = training
        self.tool_parser = tool_parser
        self.limits = limits
        self.timeout_s = timeout_s
        self.calls: list[_Call] = []
        self.sequences: list[Trajectory] = []
        self.failure: EpisodeFailure | None = None
        """Why the episode cannot be trained on (a limit broken, an inference failure), once it cannot."""
        self.clock = ProgramClock()

    # ---- the route -------------------------------------------------------------------------------

    async def chat(self, body: ChatBody) -> dict[str, Any]:
        """Answer one ``chat.completions.create`` call (raises `_Refused` with the HTTP status)."""
        if self.failure is not None:
            raise _Refused(400, f"this episode has ended: {self.failure.reason}")
        if self.limits.max_calls is not None and len(self.calls) >= self.limits.max_calls:
            raise self._fail(429, "limit", f"more than max_calls={self.limits.max_calls} calls")
        extra = body.model_extra or {}
        _refuse_unsupported(extra)
        tools = extra.get("tools") or None
        if tools and self.tool_parser is None:
            raise _Refused(400, "tools: this environment has no tool_parser (agent_args.tool_parser)")
        args = self._call_args(body, len(self.calls))
        template_kwargs = {**(args.chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        keys = [_message_key(m) for m in body.messages]
        try:
            prompt_ids = self._prompt_ids(body.messages, keys, template_kwargs)
        except Exception as exc:  # noqa: BLE001 - the template's verdict on the program's messages
            raise _Refused(400, f"messages: the chat template cannot render them: {exc}") from None
        request = InferenceRequest(prompt="", prompt_token_ids=prompt_ids, generation_args=args, n=body.n)
        try:
            with self.clock.waiting():
                responses = await asyncio.wait_for(self.inference.agenerate(request), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed inference fails the episode, not the run
            if isinstance(exc, ValueError) and not isinstance(exc, UnsupportedServerError):
                # The interface's verdict on the program's request (prompt too long, ...): the program's
                # to handle. A server that cannot serve training, or answers 4xx/5xx, fails the episode.
                raise _Refused(400, str(exc)) from None
            raise self._fail(502, "inference", f"{type(exc).__name__}: {exc}") from None
        parsed = [
            self.tool_parser(r.text) if tools and self.tool_parser else ParsedCompletion(r.text, [])
            for r in responses
        ]
        index = len(self.calls)
        messages = [_assistant_message(p, index, i) for i, p in enumerate(parsed)]
        self.calls.append(
            _Call(keys, prompt_ids, responses, [_message_key(OpenAIMessage(**m)) for m in messages])
        )
        self._record(prompt_ids, responses, args)
        total = sum(len(s.tokens) for s in self.sequences)
        if self.limits.max_tokens is not None and total > self.limits.max_tokens:
            raise self._fail(
                429, "limit", f"{total} tokens, more than max_episode_tokens={self.limits.max_tokens}"
            )
        return _chat_response(body, responses, parsed, messages, self.tokenizer)

    def _fail(self, status: int, stage: FailureStage, detail: str) -> _Refused:
        """End the episode: record why, and answer the call that ended it with `status`."""
        self.failure = EpisodeFailure(stage, detail)
        return _Refused(status, self.failure.reason)

    def _call_args(self, body: ChatBody, index: int) -> GenerationArgs:
        """The episode's sampling options with those the call sets laid over them."""
        names = body.model_fields_set
        overrides: dict[str, Any] = {
            name: getattr(body, name)
            for name in (*_DISTRIBUTION_OPTIONS, "repetition_penalty", "presence_penalty", "min_tokens")
            if name in names
        }
        overrides |= {name: getattr(body, name) for name in ("ignore_eos", "seed") if name in names}
        if "top_k" in overrides:
            overrides["top_k"] = max(overrides["top_k"], 0)  # -1 is vLLM's spelling of off
        if names & {"max_tokens", "max_completion_tokens"}:
            overrides["max_tokens"] = body.completion_limit()
        if body.stop is not None:
            overrides["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
        if body.stop_token_ids is not None:
            overrides["stop_token_ids"] = tuple(body.stop_token_ids)
        if body.chat_template_kwargs is not None:
            overrides["chat_template_kwargs"] = body.chat_template_kwargs
        try:
            args = self.args.merge(overrides)
        except ValidationError as exc:
            raise _Refused(400, validation_problems(exc.errors())) from None
        if self.training and args.untrainable_options:
            raise _Refused(
                400,
                f"{args.untrainable_options} change the sampled distribution in ways the trainer cannot "
                "reproduce in its logprobs; they are refused in training episodes",
            )
        if self.training and args.temperature == 0:
            raise _Refused(400, "temperature 0 (greedy) leaves no distribution to train on")
        # Calls the program seeds keep their seed; the others get one per call of a seeded run.
        return args if "seed" in overrides else request_args(args, "call", index)

    # ---- prompts ---------------------------------------------------------------------------------

    def _prompt_ids(
        self, messages: list[OpenAIMessage], keys: list[tuple], template_kwargs: dict[str, Any]
    ) -> list[int]:
        """The call's prompt ids: an earlier call's ids and sampled reply, then the messages after them
        (see the module docstring); else the template's rendering of all the messages."""
        for call in reversed(self.calls):
            head = len(call.messages)
            if len(keys) <= head + 1 or keys[:head] != call.messages:
                continue
            for reply, response in zip(call.replies, call.responses, strict=True):
                if keys[head] == reply:
                    prefix = call.prompt_ids + list(response.token_ids)
                    rest = [_template_message(m) for m in messages[head + 1 :]]
                    return prefix + follow_up_ids(self.tokenizer, prefix, rest, template_kwargs)
        rendered = self.tokenizer.apply_chat_template(
            [_template_message(m) for m in messages],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **template_kwargs,
        )
        return list(rendered)

    # ---- sequences -------------------------------------------------------------------------------

    def _record(
        self, prompt_ids: list[int], responses: list[InferenceResponse], args: GenerationArgs
    ) -> None:
        """Extend the longest open sequence the prompt continues (first choice), or start new ones."""
        options = _distribution(args)
        extended = max(
            (
                s
                for s in self.sequences
                if _distribution(s.args) == options and prompt_ids[: len(s.tokens)] == s.tokens
            ),
            key=lambda s: len(s.tokens),
            default=None,
        )
        for index, response in enumerate(responses):
            sequence = extended if index == 0 and extended is not None else None
            if sequence is None:
                sequence = Trajectory(args)
                self.sequences.append(sequence)
            between = prompt_ids[len(sequence.tokens) :]
            if between:
                sequence.add_context(between, self.tokenizer.decode(between))
            sequence.add_completion(response)

    def rollout(
        self, env_id: str, problem_id: str, reward: float, components: dict[str, float]
    ) -> TokenRollout:
        """The episode as one rollout: the sequence of its last call, the others as `extra_sequences`."""
        last = self.sequences[-1]
        return last.rollout(env_id, problem_id, reward, components).model_copy(
            update={
                "extra_sequences": [
                    s.rollout(env_id, problem_id, reward, components) for s in self.sequences if s is not last
                ]
            }
        )

    def transport(self) -> EpisodeTransport:
        return EpisodeTransport(self)


class EpisodeTransport(httpx.AsyncBaseTransport):
    """Answers an episode's OpenAI client in process; nothing else is reachable through it."""

    def __init__(self, episode: Episode):
        self.episode = episode

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.rstrip("/")
        try:
            if request.method == "POST" and path.endswith("/chat/completions"):
                try:
                    body = ChatBody.model_validate_json(await request.aread())
                except ValidationError as exc:
                    raise _Refused(400, validation_problems(exc.errors())) from None
                return httpx.Response(200, json=await self.episode.chat(body))
            if request.method == "GET" and path.endswith("/models"):
                card = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "llmrl"}
                return httpx.Response(200, json={"object": "list", "data": [card]})
            raise _Refused(404, f"{request.method} {path}: this endpoint serves chat completions only")
        except _Refused as refused:
            error = {"message": refused.message, "type": "invalid_request_error", "code": refused.status}
            return httpx.Response(refused.status, json={"error": error})


def _refuse_unsupported(extra: dict[str, Any]) -> None:
    for name, neutral in _UNSUPPORTED.items():
        value = extra.get(name)
        if value is not None and value != neutral and value is not False:
            raise _Refused(400, f"{name} is not supported by this endpoint (got {value!r})")


def _distribution(args: GenerationArgs) -> tuple:
    return tuple(getattr(args, name) for name in _DISTRIBUTION_OPTIONS)


def _arguments(text: str) -> Any:
    """Tool-call arguments as a chat template expects them (a mapping), or the text when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _message_key(message: OpenAIMessage) -> tuple:
    """What two messages must share to be the same turn (tool-call ids aside: the program echoes ours)."""
    calls = tuple(
        (c.function.name, json.dumps(_arguments(c.function.arguments), sort_keys=True))
        for c in message.tool_calls or ()
    )
    return (message.role, message.text, calls, message.tool_call_id if message.role == "tool" else None)


def _template_message(message: OpenAIMessage) -> dict[str, Any]:
    """A message in the form chat templates read (Hugging Face's: tool-call arguments as a mapping)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _assistant_message(parsed: ParsedCompletion, call: int, choice: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{call}_{choice}_{k}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for k, c in enumerate(parsed.tool_calls)
        ]
    return message


def _chat_response(
    body: ChatBody,
    responses: list[InferenceResponse],
    parsed: list[ParsedCompletion],
    messages: list[dict[str, Any]],
    tokenizer: Any,
) -> dict[str, Any]:
    want_logprobs = bool(body.logprobs)
    choices = []
    for index, (response, completion, message) in enumerate(zip(responses, parsed, messages, strict=True)):
        finish = "tool_calls" if completion.tool_calls else response.finish_reason
        choices.append(
            {
                "index": index,
                "message": message,
                "finish_reason": "stop" if finish == "abort" else finish,
                "logprobs": _logprobs(response, tokenizer) if want_logprobs else None,
            }
        )
    prompt_tokens = len(responses[0].prompt_token_ids)
    completion_tokens = sum(len(r.token_ids) for r in responses)
    return {
        "id": f"chatcmpl-{time.time_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model or MODEL_NAME,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _logprobs(response: InferenceResponse, tokenizer: Any) -> dict[str, Any]:
    pieces = tokenizer.batch_decode([[t] for t in response.token_ids])
    content = [
        {"token": piece, "logprob": value, "bytes": list(piece.encode()), "top_logprobs": []}
        for piece, value in zip(pieces, response.logprobs or [0.0] * len(pieces), strict=True)
    ]
    return {"content": content, "refusal": None}
