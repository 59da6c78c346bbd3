"""LLM judges: a reward function entry ``{judge: {...}, weight, name}`` that asks a model to grade.

Each completion becomes one chat request to the judge: `template` filled with the problem's question,
the completion, the reference answer and the data row's columns, after an optional system prompt. The
judge's answer (its reasoning between ``<think>`` tags left out) becomes a number by `parser`:

* ``verdict``: the last of the `verdicts` words the answer names, as whole words, in any case
  (``CORRECT`` 1.0, ``INCORRECT`` 0.0 by default), its value;
* ``score``: the last number in the answer (or `score_pattern`'s first group, else its match), mapped
  from `score_range` onto [0, 1] when one is given (a number outside it fails);
* ``module:function`` of a plug-in: ``function(answer_text) -> float | None``; None: not scored.

The judge is a model behind an OpenAI-compatible chat endpoint (`url`), a server llmrl starts when the
environment is built and stops when the process ends (`serve`: `llmrl serve-inference` or vLLM, its log
in a ``llmrl-judge-*`` temporary folder), or, with neither, the policy's own inference interface (as
NeMo-RL's default judge is): the same engine or server that samples the rollouts, at the weights it
holds when asked.

Requests run `max_concurrent` at a time per judge, each under `timeout_s`; a request to a URL or a
started server that gets no answer, a 5xx or a 429 is tried again up to `max_retries` times (the
policy's interface retries as it does for rollouts). A grade is cached per (prompt, completion), the
whole judge prompt being the key: a completion seen again (a repeated problem, the greedy evaluation
sample) is not asked twice while the cache holds it. A judge that fails (no answer after the retries,
an answer with no verdict or number, a parser that raises) fails that rollout with a `UserCodeFailure`
naming the entry and the cause, counted with the environment's reward failures; it is never scored 0.
"""

from __future__ import annotations

import asyncio
import collections
import math
import re
import string
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmrl.config import ConfigError, ServeConfig
from llmrl.errors import UserCodeFailure, code_location
from llmrl.http_client import HTTPRequestError, RetryPolicy, send
from llmrl.inference.managed_server import ManagedModelServer, start_model_server
from llmrl.inference.openai import api_key_from_env, normalise_base_url
from llmrl.registry import RegistryError, resolve_function
from llmrl.rewards.functions import Caller, PolicyInference, RewardFunction, Sample, Score, finite_number
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest, validation_problems

ENTRY_KEYS: tuple[str, ...] = ("judge", "weight", "name")

DEFAULT_TEMPLATE = """\
Grade a response to a question against the question's reference answer.

Question:
{question}

Reference answer:
{answer}

Response:
{completion}

Does the response's final answer agree with the reference answer? Reply with one word: CORRECT or \
INCORRECT."""

TEMPLATE_FIELDS: tuple[str, ...] = ("question", "completion", "answer")
"""The fields a template may use besides the data row's columns."""

_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL)
_NUMBER = r"[-+]?\d+(?:\.\d+)?"


class JudgeSettings(BaseModel):
    """The ``judge:`` mapping of a reward function entry (the module docstring says what each does)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str | None = None
    """An OpenAI-compatible API root (``http://host:8000/v1``) of the judge."""
    model: str | None = None
    """The model name sent to `url`; None: the first the server lists."""
    api_key_env: str | None = None
    """The environment variable holding `url`'s bearer token."""
    serve: ServeConfig | None = None
    """A server llmrl starts for the judge instead (`llmrl serve-inference` or vLLM, of `serve.model`)."""
    template: str = DEFAULT_TEMPLATE
    """The user message: ``str.format`` fields ``{question}``, ``{completion}``, ``{answer}`` and the
    data row's columns."""
    system_prompt: str | None = None
    parser: str = "verdict"
    """``verdict``, ``score`` or a plug-in's ``module:function``."""
    verdicts: dict[str, float] = Field(default_factory=lambda: {"CORRECT": 1.0, "INCORRECT": 0.0})
    score_pattern: str | None = None
    score_range: tuple[float, float] | None = None
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    max_concurrent: int = Field(16, ge=1)
    timeout_s: float = Field(60.0, gt=0)
    max_retries: int = Field(2, ge=0)
    cache_size: int = Field(10_000, ge=0)
    """Grades kept (least recently used dropped first); 0: none."""

    @field_validator("template")
    @classmethod
    def _template_shows_the_completion(cls, template: str) -> str:
        if "completion" not in template_fields(template):
            raise ValueError("the template never shows the judge the completion; put {completion} in it")
        return template

    @field_validator("verdicts")
    @classmethod
    def _verdicts_are_words(cls, verdicts: dict[str, float]) -> dict[str, float]:
        if not verdicts:
            raise ValueError("name at least one verdict, e.g. {CORRECT: 1.0, INCORRECT: 0.0}")
        folded = [word.casefold() for word in verdicts]
        if len(set(folded)) != len(folded) or not all(word.strip() for word in verdicts):
            raise ValueError(f"the verdicts must be distinct words in any case, got {list(verdicts)}")
        if not all(math.isfinite(value) for value in verdicts.values()):
            raise ValueError("every verdict's value must be a finite number")
        return verdicts

    @field_validator("score_pattern")
    @classmethod
    def _pattern_compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return pattern

    @model_validator(mode="after")
    def _consistent(self) -> JudgeSettings:
        if self.url is not None and self.serve is not None:
            raise ValueError("give url (a server you run) or serve (one llmrl starts), not both")
        if (self.model is not None or self.api_key_env is not None) and self.url is None:
            raise ValueError("model and api_key_env belong to url")
        low, high = self.score_range or (0.0, 1.0)
        if not low < high:
            raise ValueError(
                f"score_range: expected [low, high] with low < high, got {list(self.score_range or ())}"
            )
        return self


def template_fields(template: str) -> list[str]:
    """The names `template`'s ``str.format`` fields use (``{row[col]}`` counts as ``row``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"the template is no str.format template: {exc}") from None
    return [re.split(r"[.\[]", name, maxsplit=1)[0] for _, name, _, _ in parsed if name]


Parser = Callable[[str], float | None]


class Judge:
    """Grades completions by asking a model: `grade` gives one sample's `Score` (or raises its failure),
    `grade_group` a group's, each failure in place of its score."""

    def __init__(
        self,
        settings: JudgeSettings,
        where: str,
        *,
        base_url: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        server: ManagedModelServer | None = None,
    ):
        """`where`: the config path errors start with; `base_url`: the judge's server (None: the policy's
        inference); `transport`: httpx's (tests pass an ASGI app's); `server`: the one llmrl started at
        `base_url`, which lives as long as the judge."""
        self.settings = settings
        self.server = server
        self.where = where
        self.base_url = normalise_base_url(base_url) if base_url is not None else None
        self.parse = self._parser()
        self._model = settings.model
        api_key = api_key_from_env(settings.api_key_env, f"{where}.judge.api_key_env")
        self._client_settings = {
            "base_url": self.base_url or "",
            "headers": {"Authorization": f"Bearer {api_key}"} if api_key else {},
            "transport": transport,
            "limits": httpx.Limits(max_connections=settings.max_concurrent),
        }
        self._retry = RetryPolicy(settings.timeout_s, retries=settings.max_retries)
        self._grades: collections.OrderedDict[tuple[str, str], Score] = collections.OrderedDict()
        self.counts: collections.Counter[str] = collections.Counter()
        """Requests sent (`requests`) and grades given without one (`cache_hits`: cached, or asked by
        another caller at the same time), since `pop_counts`."""
        self._per_loop: dict[asyncio.AbstractEventLoop, _LoopState] = {}

    def pop_counts(self) -> dict[str, float]:
        counts = {key: float(count) for key, count in self.counts.items()}
        self.counts.clear()
        return counts

    @property
    def endpoint(self) -> str:
        return self.base_url or "the policy's inference"

    def _parser(self) -> Parser:
        settings = self.settings
        if settings.parser == "verdict":
            return self._verdict
        if settings.parser == "score":
            return self._score
        try:
            function = resolve_function(settings.parser)
        except RegistryError as exc:
            raise ConfigError(
                f"{self.where}.judge.parser: expected verdict, score or a plug-in's module:function; {exc}"
            ) from None
        return function

    # ---- asking ---------------------------------------------------------------------------------

    def messages(self, sample: Sample) -> list[ChatMessage]:
        """The judge's request for `sample`: the system prompt, then the filled template."""
        fields = {**sample.columns, "question": question_of(sample.prompt), "completion": sample.completion}
        if sample.ground_truth is not None:
            fields["answer"] = sample.ground_truth
        try:
            text = self.settings.template.format_map(fields)
        except KeyError as exc:
            missing = exc.args[0]
            why = (
                "the problem has no reference answer (set answer_column)"
                if missing == "answer"
                else f"the data has no such column; its columns are {sorted(sample.columns)}"
            )
            raise UserCodeFailure(f"{self.where}.judge.template", f"uses {{{missing}}}, but {why}") from None
        user = ChatMessage(role="user", content=text)
        if not self.settings.system_prompt:
            return [user]
        return [ChatMessage(role="system", content=self.settings.system_prompt), user]

    async def grade_group(
        self, samples: Sequence[Sample], policy: PolicyInference | None
    ) -> list[Score | Exception]:
        """Every sample's grade, asked concurrently (`max_concurrent` at a time across all groups)."""
        return list(await asyncio.gather(*(self._failure_in_place(sample, policy) for sample in samples)))

    async def _failure_in_place(self, sample: Sample, policy: PolicyInference | None) -> Score | Exception:
        try:
            return await self.grade(sample, policy)
        except UserCodeFailure as exc:
            return exc

    async def grade(self, sample: Sample, policy: PolicyInference | None) -> Score:
        """`sample`'s grade, from the cache or asked once however many callers wait for it; raises
        `UserCodeFailure` when the judge fails."""
        messages = self.messages(sample)
        key = (messages[0].content if len(messages) == 2 else "", messages[-1].content)
        if key in self._grades:
            self._grades.move_to_end(key)
            self.counts["cache_hits"] += 1
            return self._grades[key]
        state = self._state()
        pending = state.pending.get(key)
        self.counts["cache_hits" if pending is not None else "requests"] += 1
        if pending is None:
            pending = state.pending[key] = asyncio.ensure_future(self._ask_and_parse(messages, policy, state))
            pending.add_done_callback(lambda _: state.pending.pop(key, None))
        grade = await asyncio.shield(pending)
        if self.settings.cache_size:
            self._grades[key] = grade
            while len(self._grades) > self.settings.cache_size:
                self._grades.popitem(last=False)
        return grade

    async def _ask_and_parse(
        self, messages: list[ChatMessage], policy: PolicyInference | None, state: _LoopState
    ) -> Score:
        async with state.slots:
            answer = await self._ask(messages, policy, state)
        return self._value(answer), {}

    async def _ask(
        self, messages: list[ChatMessage], policy: PolicyInference | None, state: _LoopState
    ) -> str:
        settings = self.settings
        if self.base_url is None:
            if policy is None:
                raise UserCodeFailure(
                    f"{self.where}.judge",
                    "the policy's inference is not at hand here; give the judge a url or serve",
                )
            request = InferenceRequest(
                prompt=messages,
                generation_args=GenerationArgs(
                    temperature=settings.temperature, max_tokens=settings.max_tokens
                ),
            )
            try:
                (response,) = await asyncio.wait_for(policy.agenerate(request), settings.timeout_s)
            except TimeoutError:
                raise self._failed(f"no answer within timeout_s={settings.timeout_s:g} s") from None
            except Exception as exc:
                raise self._failed(f"{type(exc).__name__}: {exc}") from None
            return response.text
        body = {
            "model": self._model or await self._first_model(state),
            "messages": [message.model_dump() for message in messages],
            "max_tokens": settings.max_tokens,
            "temperature": settings.temperature,
        }
        data = await self._call(state, "POST", "/chat/completions", json=body)
        try:
            content = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise self._failed(f"the answer has no choices[0].message.content: {str(data)[:200]}") from None
        if not isinstance(content, str):
            raise self._failed(f"choices[0].message.content is {content!r}, not text")
        return content

    async def _first_model(self, state: _LoopState) -> str:
        async with state.naming:
            if self._model is None:
                data = await self._call(state, "GET", "/models")
                try:
                    self._model = str(data["data"][0]["id"])
                except (KeyError, IndexError, TypeError):
                    raise self._failed("/models lists no model; name one (judge.model)") from None
        return self._model

    async def _call(self, state: _LoopState, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await send(state.client(), method, path, self._retry, **kwargs)
        except HTTPRequestError as exc:
            raise self._failed(exc.failure) from None
        try:
            return response.json()
        except ValueError:
            raise self._failed(f"{path} answered with no JSON") from None

    def _failed(self, cause: str) -> UserCodeFailure:
        return UserCodeFailure(f"{self.where}.judge ({self.endpoint})", cause)

    def _state(self) -> _LoopState:
        # A semaphore, a lock and an HTTP client belong to one event loop; the sync entry points start
        # a new loop per call, whose state goes with it.
        loop = asyncio.get_running_loop()
        for old in [other for other in self._per_loop if other.is_closed()]:
            del self._per_loop[old]
        if loop not in self._per_loop:
            self._per_loop[loop] = _LoopState(self.settings.max_concurrent, self._client_settings)
        return self._per_loop[loop]

    # ---- parsing --------------------------------------------------------------------------------

    def _value(self, answer: str) -> float | None:
        """The judge's `answer` as a number (None: not scored), or a failure naming what it said."""
        text = _THINKING.sub("", answer).strip()
        try:
            value = self.parse(text)
        except UserCodeFailure:
            raise
        except Exception as exc:  # a plug-in parser raised
            raise UserCodeFailure(code_location(exc, self.parse), f"{type(exc).__name__}: {exc}") from exc
        if value is None:
            return None
        number = finite_number(value)
        if number is None:
            raise UserCodeFailure.returned(code_location(None, self.parse), value, "a finite number or None")
        return number

    def _verdict(self, text: str) -> float:
        verdicts = self.settings.verdicts
        words = "|".join(re.escape(word) for word in sorted(verdicts, key=len, reverse=True))
        found = re.findall(rf"(?<!\w)({words})(?!\w)", text, flags=re.IGNORECASE)
        if not found:
            raise self._unreadable(text, f"names none of the verdicts {list(verdicts)}")
        by_word = {word.casefold(): value for word, value in verdicts.items()}
        return by_word[found[-1].casefold()]

    def _score(self, text: str) -> float:
        pattern = re.compile(self.settings.score_pattern or _NUMBER)
        matches = list(pattern.finditer(text))
        if not matches:
            raise self._unreadable(text, f"has no number matching {pattern.pattern!r}")
        last = matches[-1]
        try:
            number = float(last.group(1) if pattern.groups else last.group(0))
        except (TypeError, ValueError):
            raise self._unreadable(text, f"{last.group(0)!r} is no number") from None
        if self.settings.score_range is None:
            return number
        low, high = self.settings.score_range
        if not low <= number <= high:
            raise self._unreadable(text, f"its score {number:g} is outside score_range [{low:g}, {high:g}]")
        return (number - low) / (high - low)

    def _unreadable(self, text: str, why: str) -> UserCodeFailure:
        shown = text if len(text) <= 120 else f"{text[:117]}..."
        return self._failed(f"the judge's answer {why}: {shown!r}")


class _LoopState:
    """What one event loop holds of a judge: its request slots, its requests in flight by key, the lock
    under which the first request asks the server for its model, and its HTTP client (made with
    `client_settings` when first needed)."""

    def __init__(self, max_concurrent: int, client_settings: dict[str, Any]):
        self.slots = asyncio.Semaphore(max_concurrent)
        self.pending: dict[tuple[str, str], asyncio.Future[Score]] = {}
        self.naming = asyncio.Lock()
        self._client_settings = client_settings
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(**self._client_settings)
        return self._client


def question_of(prompt: str | list[dict[str, str]]) -> str:
    """The question a judge is shown: a text prompt, or a chat prompt's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [message["content"] for message in prompt if message.get("role") == "user"]
    return users[-1] if users else prompt[-1]["content"]


class JudgeReward(RewardFunction):
    """A reward function entry whose values a `Judge` gives (its `function`)."""

    @property
    def judge(self) -> Judge:
        assert isinstance(self.function, Judge)
        return self.function

    @property
    def location(self) -> str:
        return f"{self.judge.where}.judge"

    async def score_group(
        self, samples: Sequence[Sample], call: Caller, policy: PolicyInference | None = None
    ) -> list[Score | Exception]:
        """Each sample's grade; the requests wait on the judge's own limits (`max_concurrent`,
        `timeout_s` per attempt), not on the reward functions' calls."""
        del call
        return await self.judge.grade_group(samples, policy)

    def check_columns(self, columns: list[str], where: str) -> None:
        """The template may use only its own fields and the data's columns (checked before training)."""
        unknown = [
            f for f in template_fields(self.judge.settings.template) if f not in (*TEMPLATE_FIELDS, *columns)
        ]
        if unknown:
            raise ValueError(
                f"{where}: {self.location}.template uses {{{unknown[0]}}}, which is neither "
                f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} nor a column of the data ({columns})"
            )


def judge_reward_function(
    entry: Mapping[str, Any], where: str, *, transport: httpx.AsyncBaseTransport | None = None
) -> JudgeReward:
    """The reward function of an entry ``{judge: {...}, weight, name}``; `where` prefixes errors. Its name
    defaults to ``judge``. `transport`: httpx's for the judge's requests (tests pass an ASGI app's)."""
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; valid keys for a judge: {', '.join(ENTRY_KEYS)}")
    raw = entry.get("judge")
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}.judge: expected a mapping of the judge's settings, got {raw!r}")
    try:
        settings = JudgeSettings.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(validation_problems(exc.errors(), f"{where}.judge.")) from None
    server = None
    if settings.serve is not None:
        log_path = Path(tempfile.mkdtemp(prefix="llmrl-judge-")) / "server.log"
        server = start_model_server(settings.serve, log_path=log_path, seed=0, field=f"{where}.judge.serve")
    try:
        judge = Judge(
            settings,
            where,
            base_url=settings.url or (server and server.base_url),
            transport=transport,
            server=server,
        )
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return JudgeReward.named(judge, {"name": "judge", **entry}, where, style="trl", batch="group")
