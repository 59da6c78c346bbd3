"""ServedTeacher: a distillation teacher behind an inference server, asked for its ``prompt_logprobs``.

Each sequence the policy sampled (prompt and completion ids) is sent as the token prompt of one
``POST /v1/completions`` with ``max_tokens: 1`` and ``prompt_logprobs: k``, under a limit of requests in
flight, each retried through `llmrl.http_client`. vLLM and llmrl's server answer each choice with
``prompt_logprobs``: for each prompt token after the first, ``{token id: {"logprob", "rank"}}`` holding the
token itself and the ``k`` likeliest tokens there (``k + 1`` entries when the token is not among them),
of the teacher's distribution over its whole vocabulary. That is what the in-process teacher computes
(`llmrl.algorithms.logprobs.token_top_k`): the token's logprob, the top k, and the rest of the vocabulary
as one more outcome, here ``log(1 - sum of the top k's probabilities)``, in float64.

Temperature: vLLM's prompt logprobs skip the sampling processors, so they are at temperature 1 whatever
the request says; llmrl's server scores at the request's temperature and says so
(``prompt_logprobs_temperature``). Rollouts sampled at another temperature need llmrl's server.

Tokenizer: the scores are of the policy's token ids, so the teacher must have the policy's tokenizer.
`ServedTeacher.tokenizer_check` asks the server's ``POST /tokenize`` (vLLM's and llmrl's) for the ids of a
probe text, which holds the policy's special tokens (often the last ids of a vocabulary), and compares
them with the policy's.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import httpx
import torch

from llmrl.config import TeacherServerConfig
from llmrl.errors import UserError
from llmrl.http_client import RequestRefused, RetryPolicy, ServerUnavailable, send
from llmrl.inference.interface import InferenceUnavailableError, run_blocking
from llmrl.inference.openai import api_key_from_env, normalise_base_url

log = logging.getLogger(__name__)

TeacherOutputs = tuple[torch.Tensor, ...]
"""One sequence's scores, laid out as the in-process teacher's: its tokens' logprobs ``[T]``, and with a
top k its grouped top-k logprobs ``[T, k + 1]`` (the last: the rest of the vocabulary) and their ids
``[T, k]``; zero off the loss mask."""


TOKENIZER_PROBE = (
    "Tokenizer check: 12 + 345 = 357; x_1=-0.5e3, {'key': [True, None]}\n\tIndented   spaces.\r\n"
    "Ünïcödé naïve café, Ελληνικά, русский, 中文, 日本語, 한국어, عربى, emoji 🙂👍🏽."
)
"""Text whose tokens the teacher server and the policy must agree on: words, digits, code, whitespace and
scripts that a tokenizer of another family splits otherwise."""


class TokenizerCheck(NamedTuple):
    """What `ServedTeacher.tokenizer_check` found: `mismatch` (how the tokenizers differ, in words) or
    `unchecked` (why the server could not tell), or neither when they agree."""

    mismatch: str | None = None
    unchecked: str | None = None


class TeacherServerError(UserError):
    """The teacher server refused a request or answered with what cannot be used; the message names the
    field."""


class ServedTeacher:
    """A teacher's scores of sampled sequences, from the server at `base_url`."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        max_concurrent: int = 16,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        """`model`: the name sent (None: the server's first); `transport`: the httpx transport (tests pass
        an ASGI app's); the rest as `TeacherServerConfig`'s fields."""
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.base_url = normalise_base_url(base_url)
        self.model = model
        self.max_concurrent = max_concurrent
        self.policy = RetryPolicy(timeout_s, retries=max_retries, backoff_s=backoff_s)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport

    @classmethod
    def from_config(cls, config: TeacherServerConfig) -> ServedTeacher:
        """The client of `config.url`; a `serve` server is started first, and its url put there (the trainer)."""
        if config.url is None:
            raise ValueError("distillation.teacher_server: a `serve` server is asked at its url once started")
        return cls(
            config.url,
            model=config.model,
            api_key=api_key_from_env(config.api_key_env, "distillation.teacher_server.api_key_env"),
            max_concurrent=config.max_concurrent,
            timeout_s=config.request_timeout_s,
            max_retries=config.max_retries,
        )

    def tokenizer_check(self, tokenizer: Any) -> TokenizerCheck:
        """Whether the server tokenizes `TOKENIZER_PROBE` and `tokenizer`'s special tokens into the ids
        `tokenizer` (the policy's) does; a server without ``POST /tokenize`` leaves it `unchecked`."""
        probe = TOKENIZER_PROBE + "".join(tokenizer.all_special_tokens)
        return run_blocking(self._tokenizer_check(probe, tokenizer))

    async def _tokenizer_check(self, probe: str, tokenizer: Any) -> TokenizerCheck:
        # vLLM's /tokenize sits beside the API root, not under /v1; it takes the model it serves.
        body = {"prompt": probe, "add_special_tokens": False, "return_token_strs": True}
        async with httpx.AsyncClient(
            base_url=self.base_url.removesuffix("/v1"), headers=self._headers, transport=self._transport
        ) as client:
            answer = await self._call(client, "POST", "/tokenize", json=body, missing_route_ok=True)
        if answer is None:
            return TokenizerCheck(unchecked=f"{self.base_url.removesuffix('/v1')}/tokenize is not found")
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise self._malformed("tokens", "is not a list of token ids")
        pieces = answer.get("token_strs")
        theirs = pieces if isinstance(pieces, list) and len(pieces) == len(tokens) else None
        ours = tokenizer(probe, add_special_tokens=False)["input_ids"]
        for t, (teacher, policy) in enumerate(zip(tokens, ours, strict=False)):
            if teacher != policy:
                teacher_piece = f" {theirs[t]!r}" if theirs is not None else ""
                policy_piece = repr(tokenizer.convert_ids_to_tokens(policy))
                return TokenizerCheck(
                    mismatch=f"token {t} of a probe text is {teacher}{teacher_piece} in the teacher, "
                    f"{policy} {policy_piece} in the policy"
                )
        if len(tokens) != len(ours):
            return TokenizerCheck(
                mismatch=f"a probe text is {len(tokens)} tokens in the teacher, {len(ours)} in the policy"
            )
        return TokenizerCheck()

    def score(
        self,
        sequences: Sequence[list[int]],
        masks: Sequence[list[bool]],
        temperatures: Sequence[float],
        top_k: int | None,
    ) -> list[TeacherOutputs]:
        """Each sequence scored at its temperature: `TeacherOutputs`, with the top `top_k` unless None.
        A server that does not answer raises `InferenceUnavailableError`; one that refuses or answers
        with what cannot be used, `TeacherServerError`."""
        return run_blocking(self._score(sequences, masks, temperatures, top_k))

    async def _score(
        self,
        sequences: Sequence[list[int]],
        masks: Sequence[list[bool]],
        temperatures: Sequence[float],
        top_k: int | None,
    ) -> list[TeacherOutputs]:
        slots = asyncio.Semaphore(self.max_concurrent)
        limits = httpx.Limits(max_connections=self.max_concurrent)
        async with httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, transport=self._transport, limits=limits
        ) as client:
            if self.model is None:
                self.model = await self._first_model(client)
            model = self.model

            async def one(ids: list[int], mask: list[bool], temperature: float) -> TeacherOutputs:
                async with slots:
                    answer = await self._post(client, model, ids, temperature, top_k or 0)
                return self._outputs(answer, ids, mask, temperature, top_k)

            return list(
                await asyncio.gather(
                    *(one(s, m, t) for s, m, t in zip(sequences, masks, temperatures, strict=True))
                )
            )

    async def _post(
        self, client: httpx.AsyncClient, model: str, ids: list[int], temperature: float, k: int
    ) -> Any:
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": temperature,
            "prompt_logprobs": k,
        }
        return await self._call(client, "POST", "/completions", json=body)

    async def _first_model(self, client: httpx.AsyncClient) -> str:
        data = await self._call(client, "GET", "/models")
        try:
            return str(data["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise TeacherServerError(
                f"distillation.teacher_server.model: {self.base_url}/models lists no model; name one"
            ) from None

    async def _call(
        self, client: httpx.AsyncClient, method: str, path: str, missing_route_ok: bool = False, **kwargs: Any
    ) -> Any:
        """The JSON answer; with `missing_route_ok`, None where the server has no such route (404, 405)."""
        try:
            response = await send(client, method, path, self.policy, **kwargs)
        except ServerUnavailable as exc:
            raise InferenceUnavailableError(
                f"distillation teacher server at {self.base_url} not answering ({exc.failure}); nothing of "
                "this step was trained on; rerun the same command to resume"
            ) from None
        except RequestRefused as exc:
            if missing_route_ok and exc.status in (404, 405):
                return None
            raise TeacherServerError(
                f"distillation.teacher_server: {self.base_url}{path} refused the request: {exc.failure}"
            ) from None
        try:
            return response.json()
        except ValueError:
            raise self._malformed("the answer", "is not JSON") from None

    def _outputs(
        self, answer: Any, ids: list[int], mask: list[bool], temperature: float, top_k: int | None
    ) -> TeacherOutputs:
        """One answer as `TeacherOutputs` of `ids`, filled where `mask` is True."""
        served = answer.get("prompt_logprobs_temperature", 1.0) if isinstance(answer, dict) else 1.0
        if not isinstance(served, int | float):
            raise self._malformed("prompt_logprobs_temperature", "is not a number")
        if not math.isclose(served, temperature, rel_tol=1e-9):
            raise TeacherServerError(
                f"prompt_logprobs_temperature: the teacher server at {self.base_url} scores at temperature "
                f"{served} (vLLM's prompt logprobs: always 1), but the rollouts were sampled at {temperature}; "
                "sample at temperature 1, or serve the teacher with `llmrl serve-inference`"
            )
        choices = answer.get("choices") if isinstance(answer, dict) else None
        positions = choices[0].get("prompt_logprobs") if isinstance(choices, list) and choices else None
        if not isinstance(positions, list) or len(positions) != len(ids):
            found = len(positions) if isinstance(positions, list) else "none"
            raise self._malformed(
                "choices[0].prompt_logprobs", f"has {found} entries for a prompt of {len(ids)} tokens"
            )
        logprobs = torch.zeros(len(ids))
        scored = [t for t in range(1, len(ids)) if mask[t]]
        tops: list[list[tuple[float, int]]] = []
        for t in scored:
            token, top = self._position(positions[t], ids[t], top_k, t)
            logprobs[t] = token
            tops.append(top)
        if top_k is None:
            return (logprobs,)
        width = len(tops[0]) if tops else top_k
        if any(len(top) != width for top in tops):
            raise self._malformed(
                "choices[0].prompt_logprobs", "has positions with different numbers of tokens"
            )
        grouped = torch.zeros(len(ids), width + 1)
        top_ids = torch.zeros(len(ids), width, dtype=torch.int64)
        if scored:
            values = torch.tensor([[v for v, _ in top] for top in tops], dtype=torch.float64)
            top_ids[scored] = torch.tensor([[i for _, i in top] for top in tops], dtype=torch.int64)
            # Fewer than k tokens: the server gave its whole vocabulary, and there is no rest.
            mass = values.exp().sum(-1).clamp(max=1.0) if width == top_k else torch.ones(len(scored))
            grouped[scored] = torch.cat([values, torch.log1p(-mass)[:, None]], dim=-1).float()
        return logprobs, grouped, top_ids

    def _position(
        self, entry: Any, token: int, top_k: int | None, t: int
    ) -> tuple[float, list[tuple[float, int]]]:
        """The logprob of `token` at position `t`, and the top k there as (logprob, id), likeliest first."""
        field = f"choices[0].prompt_logprobs[{t}]"
        if not isinstance(entry, dict):
            raise self._malformed(field, "is not an object of token ids")
        try:
            values = [(float(v["logprob"]), int(key)) for key, v in entry.items()]
        except (KeyError, TypeError, ValueError):
            raise self._malformed(
                field, "has an entry without a numeric `logprob` or a token-id key"
            ) from None
        own = [value for value, key in values if key == token]
        if not own:
            raise self._malformed(field, f"lacks the prompt's token {token}")
        if top_k is None:
            return own[0], []
        # The token itself comes as one more entry when it is not among the k likeliest, and is then the
        # least likely of them all.
        values.sort(key=lambda pair: -pair[0])
        return own[0], values[:top_k]

    def _malformed(self, field: str, problem: str) -> TeacherServerError:
        return TeacherServerError(
            f"{field}: the teacher server at {self.base_url} answered with one that {problem}"
        )


def check_served_tokenizer(server: ServedTeacher, tokenizer: Any, *, teacher: str, policy: str) -> None:
    """Refuse (`TeacherServerError`) a teacher server whose tokenizer is not `tokenizer`, the policy's;
    warn when the server cannot tell. `teacher` and `policy` name the two models in the message."""
    check = server.tokenizer_check(tokenizer)
    if check.mismatch is not None:
        raise TeacherServerError(
            f"distillation.teacher_server: the tokenizer of the teacher {teacher} is not that of model.spec "
            f"{policy} ({check.mismatch}); a teacher must score the very tokens the policy samples"
        )
    if check.unchecked is not None:
        log.warning(
            "distillation.teacher_server: the tokenizer of the teacher %s could not be checked against that "
            "of model.spec %s (%s); it must be the same",
            teacher,
            policy,
            check.unchecked,
        )
