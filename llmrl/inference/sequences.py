"""What the embedded engine tracks per request and per sample, when a sample stops, and its response.

A completion ends with ``finish_reason="stop"`` at a stop token id or an eos token (the token is
kept in ``token_ids``/``logprobs``, dropped from ``text`` when it is special), or when a stop
string appears in the decoded text (detected incrementally with a ``tokenizers.DecodeStream``;
``text`` is cut before the stop string, while ``token_ids`` keep every sampled token, as vLLM
does, so token trajectories stay exact); else ``"length"`` after ``max_tokens``.
"""

from __future__ import annotations

import random
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers.decoders import DecodeStream

from llmrl.inference.kv_cache import list_tensor
from llmrl.inference.sampling import penalize
from llmrl.models.routing import routes_to_wire
from llmrl.types import FinishReason, GenerationArgs, InferenceResponse


@dataclass(eq=False)
class PendingRequest:
    """A request from the queue until its last sample ends (prompt tokenized, seed drawn)."""

    prompt_ids: list[int]
    args: GenerationArgs
    n: int
    seed: int
    stop_ids: frozenset[int]
    future: Future
    policy_version: int = 0
    sequences: list[RunningSequence] = field(default_factory=list)
    unfinished: int = 0
    prompt_routes: torch.Tensor | None = None  # [prompt tokens, layers, k] when the engine records routes


@dataclass(eq=False)
class RunningSequence:
    """One sample of a request, a row of the running batch."""

    request: PendingRequest
    rng: random.Random | None  # None for greedy rows: they draw nothing
    stream: DecodeStream | None = None  # only when the request has stop strings
    seen: torch.Tensor | None = None  # (V,) tokens of the prompt and completion so far, for penalties
    seen_in_completion: torch.Tensor | None = None  # (V,) tokens of the completion so far
    text: str = ""  # decoded so far, only tracked for stop strings
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_changes: list[tuple[int, int]] = field(default_factory=list)  # in-flight updates it spans
    routes: list[torch.Tensor] = field(default_factory=list)  # [layers, k] of each sampled token fed back
    finish_reason: FinishReason | None = None


def finish_reason(seq: RunningSequence, token: int, tokenizer: Any, backend: Any) -> FinishReason | None:
    """Why `seq` ends with its newest `token`, or None; `backend` is the tokenizer's ``backend_tokenizer``
    (stop strings are then decoded incrementally; None: the whole completion is decoded each token)."""
    request = seq.request
    if token in request.stop_ids:
        return "stop"
    if request.args.stop and _stop_string_ended(seq, token, tokenizer, backend):
        return "stop"
    if len(seq.tokens) >= request.args.max_tokens:
        return "length"
    return None


def _stop_string_ended(seq: RunningSequence, token: int, tokenizer: Any, backend: Any) -> bool:
    stops = seq.request.args.stop
    if seq.stream is not None:
        chunk = seq.stream.step(backend, token)
        if not chunk:
            return False
        seq.text += chunk
        # A stop string completed by this chunk starts at most len(stop) - 1 characters before it.
        tail = seq.text[-(len(chunk) + max(len(s) for s in stops) - 1) :]
    else:
        seq.text = tail = tokenizer.decode(seq.tokens, skip_special_tokens=True)
    return any(s in tail for s in stops)


def response(seq: RunningSequence, tokenizer: Any) -> InferenceResponse:
    """The finished `seq` as returned to its caller, text cut before the first stop string."""
    request = seq.request
    text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in request.args.stop) if i >= 0]
    if cuts:
        text = text[: min(cuts)]
    assert seq.finish_reason is not None
    return InferenceResponse(
        text=text,
        prompt_token_ids=request.prompt_ids,
        token_ids=seq.tokens,
        logprobs=seq.logprobs,
        finish_reason=seq.finish_reason,
        policy_version=request.policy_version,
        version_changes=seq.version_changes,
        routed_experts=None
        if request.prompt_routes is None
        else routes_to_wire(torch.cat([request.prompt_routes, *(route[None] for route in seq.routes)])),
    )


def penalized(logits: torch.Tensor, running: list[RunningSequence], adjusted: list[int]) -> torch.Tensor:
    """`logits` (B, V) of the `running` rows, with the penalties and `min_tokens` bans of the rows at
    `adjusted` applied (float32)."""
    rows = [running[row] for row in adjusted]
    args = [seq.request.args for seq in rows]
    device = logits.device
    banned = torch.zeros((len(rows), logits.shape[-1]), dtype=torch.bool, device=device)
    for i, seq in enumerate(rows):
        if len(seq.tokens) < seq.request.args.min_tokens and seq.request.stop_ids:
            banned[i, list(seq.request.stop_ids)] = True
    index = list_tensor(adjusted, torch.int64, device)
    changed = penalize(
        logits[index],
        torch.stack([seq.seen for seq in rows]),
        torch.stack([seq.seen_in_completion for seq in rows]),
        list_tensor([a.repetition_penalty for a in args], torch.float32, device)[:, None],
        list_tensor([a.presence_penalty for a in args], torch.float32, device)[:, None],
        banned,
    )
    return logits.float().index_copy(0, index, changed)
