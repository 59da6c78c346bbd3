"""LocalEngine: the embedded inference engine (continuous batching, shared prefixes, exact logprobs).

docs/engine.md explains the design and its measurements; in short:

* **Continuous batching.** `agenerate` calls from any thread or event loop queue requests; one batch
  is stepped by a task on a caller's event loop (a thread only as a fallback: the primitives
  below, and `llmrl.inference.driver`, which holds the queue and the work between steps). Between decode steps finished sequences leave and waiting requests join, first come first
  served, within ``max_concurrent`` rows and ``max_batch_tokens`` of KV cache (each prompt once plus
  the generated tokens); a request is admitted whole, alone if it must. Running sequences are never
  preempted. When the batch is full, queued requests join in bunches (``ADMIT_AT_LEAST``, or after
  ``ADMISSION_WAIT`` steps): a prefill of a few prompts costs about a decode step of the batch.
* **Shared prefixes.** The ``n`` samples of a request prefill its prompt once (``decoder.py`` and the
  modules it names: KV cache, Llama/Qwen2 forward in plain torch ops, the generic fallback).
* **Prompts** (``prompts.py``), **sampling** (``sampling.py``: per-sample random streams seeded from
  ``(seed, sample index)``, so a seeded request gives the same tokens alone or beside others),
  **stops and responses** (``sequences.py``), **new weights** (read and checked by
  ``llmrl.weights.in_process``).
* **Logprobs**: one per completion token, in float32, of the distribution the token was drawn from
  (after temperature, filters and penalties; greedy requests report the temperature-1 logprob).
* **Prompt logprobs** (`prompt_logprobs`, a served distillation teacher's scores): one forward pass of a
  prompt from the caller's thread, beside the batch's steps, never during a step or a weight load.
* **Weight updates** happen between decode steps. ``weight_update="wait"``: admission pauses,
  in-flight sequences finish on the old weights (and version), then the new weights load;
  ``"abort"``: in-flight sequences end at once with ``finish_reason="abort"``; ``"in_flight"``: the
  new weights load at once and running sequences go on with them, keeping the KV cache the old
  weights computed for their tokens so far (each response's ``version_changes`` says from which
  token on). The engine serves the
  model it is given and copies new values into it (and into the Llama/Qwen2 decoder's concatenated
  q/k/v and gate/up tensors); do not change that model in place while requests run. With
  ``owns_model`` (`from_config`, the inference server) the decoder releases the model's q/k/v and
  gate/up tensors once concatenated, so the engine holds one copy of the weights.
* **Errors.** Bad requests raise `ValueError` from their own `agenerate` call; an exception inside a
  step fails that batch's requests, resets the cache, and the engine goes on serving.

The engine runs on the device of the model's parameters (CPU or CUDA).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from tokenizers.decoders import DecodeStream

from llmrl.config import InferenceConfig, ModelConfig
from llmrl.inference.decoder import CudaGraphs, Decoder, LlamaFamilyDecoder, build_decoder
from llmrl.inference.driver import EngineSteps, RequestDriver, WeightUpdateMode
from llmrl.inference.interface import Health, InferenceInterface, run_sync
from llmrl.inference.kv_cache import list_tensor
from llmrl.inference.prompts import prompt_token_ids
from llmrl.inference.sampling import (
    MAX_UNIFORM,
    RowSampling,
    adjusts_logits,
    row_sampling,
    sample_tokens,
)
from llmrl.inference.sequences import PendingRequest, RunningSequence, finish_reason, penalized, response
from llmrl.models.loading import check_supported
from llmrl.models.routing import RouteRecorder
from llmrl.types import MAX_POLICY_VERSION, InferenceRequest, InferenceResponse
from llmrl.weights import PayloadKind, WeightTransport, WeightUpdate, in_process_transports, transport_for

PROMPT_LOGPROB_CHUNK = 2**24
"""Most logprobs `LocalEngine.prompt_logprobs` holds at once (128 MiB in float64)."""


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt scored token by token (vLLM's ``prompt_logprobs``): at each position after the first, in
    float64 from the model's logits, of the distribution at the temperature asked for."""

    token_logprobs: torch.Tensor
    """(P - 1,) the logprob of each prompt token after the first."""
    ranks: torch.Tensor
    """(P - 1,) its rank there (1: the likeliest; tokens of equal logprob share a rank)."""
    top_ids: torch.Tensor
    """(P - 1, k) the k likeliest tokens there, likeliest first."""
    top_logprobs: torch.Tensor
    """(P - 1, k) their logprobs."""


@dataclass
class EngineStats:
    """Work done since the engine was built, for monitoring and benchmarks."""

    steps: int = 0
    """Engine iterations (each a decode step, a prefill, or both)."""
    prefill_tokens: int = 0
    """Prompt tokens run through the model (once per request, whatever its `n`)."""
    decode_tokens: int = 0
    """Tokens fed to decode steps (one per running row per step)."""
    completion_tokens: int = 0
    """Tokens sampled (returned in responses, aborted ones included)."""
    peak_cache_bytes: int = 0
    """Largest KV cache the decoder held (allocated capacity, not just the used part)."""


class LocalEngine(InferenceInterface):
    """Embedded `InferenceInterface` running a transformers causal LM in this process."""

    ADMIT_AT_LEAST = 1 / 4
    """Share of `max_concurrent` rows that queued requests bring before they join a full batch."""
    ADMISSION_WAIT = 16
    """Most decode steps queued requests that fit wait for the others (`_defer_admission`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_batch_tokens: int = 8192,
        max_concurrent: int = 64,
        eos_token_ids: list[int] | tuple[int, ...] | None = None,
        weight_update: WeightUpdateMode | Literal["drain"] = "wait",
        policy_version: int = 0,
        seed: int | None = None,
        owns_model: bool = False,
        record_routes: bool = False,
        cuda_graphs: CudaGraphs = "auto",
    ):
        """
        Args:
            model: a transformers causal LM; put in eval mode and served as is (device and dtype
                follow its parameters).
            tokenizer: its tokenizer (a chat template is needed for chat prompts).
            max_batch_tokens: admission budget of KV-cache tokens of the running batch (each
                request's prompt counted once, as its samples share it, plus generated tokens).
            max_concurrent: most sequences in one decode batch.
            eos_token_ids: tokens that end every completion; default: the tokenizer's eos token
                and the model's generation-config eos ids. ``()`` turns eos off (benchmarks).
            weight_update: what `update_weights` does with running sequences: ``"wait"`` for them
                (``"drain"``, its former name, still works), ``"abort"`` them, or update them
                ``"in_flight"``.
            policy_version: version stamped on responses until the first `update_weights`.
            seed: seeds the generator that picks a seed for each request without one (None: from
                the OS).
            owns_model: the model is the engine's alone, so the Llama/Qwen2 decoder may release its
                q/k/v and gate/up tensors into the concatenated copies it keeps (one copy of the
                weights instead of ~1.5; the model's forward and those tensors are gone for anyone
                else). False: the model stays whole, for callers that go on using it.
            record_routes: each response carries the experts a mixture-of-experts model's routers chose
                for every token the engine read (`InferenceResponse.routed_experts`, router replay);
                refused for a model without MoE layers.
            cuda_graphs: ``on``: decode steps over a paged KV cache at fixed bucket shapes, captured as
                CUDA graphs on a GPU and run eagerly elsewhere (Llama/Qwen2 models; `build_decoder`);
                ``off``: launched op by op; ``auto``: ``off`` until graphs have run on a card.
        """
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if weight_update == "drain":
            weight_update = "wait"
        if weight_update not in get_args(WeightUpdateMode):
            raise ValueError(f"weight_update must be 'wait', 'abort' or 'in_flight', got {weight_update!r}")
        if cuda_graphs not in get_args(CudaGraphs):
            raise ValueError(f"cuda_graphs must be 'auto', 'on' or 'off', got {cuda_graphs!r}")
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        check_supported(model.config)  # before the first generation, not after it
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.max_concurrent = max_concurrent
        self.stats = EngineStats()
        self._device = next(model.parameters()).device
        # Built before the decoder releases any of the model's tensors: updates are checked against them all.
        self._transports = in_process_transports(model, self._apply_update, max_version=MAX_POLICY_VERSION)
        self._routes = RouteRecorder(model) if record_routes else None
        self._decoder: Decoder = build_decoder(
            model,
            max_rows=max_concurrent,
            owns_model=owns_model,
            cuda_graphs=cuda_graphs,
            reserve_tokens=max_batch_tokens,
        )
        self._eos_ids = frozenset(
            _default_eos_ids(model, tokenizer) if eos_token_ids is None else eos_token_ids
        )
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # for incremental stop-string decoding
        self._seeds = random.Random(seed)
        self._seeding = threading.Lock()  # random.Random is not safe to share between threads
        # Held by each step, weight load and prompt scoring: scoring runs from its caller's thread beside
        # the steps (it needs no rows), never during one or while new weights are half copied in.
        self._model_lock = threading.Lock()
        self._version = policy_version
        self._stepped_version = policy_version  # the running rows' version at the last step
        self._requests = RequestDriver(
            EngineSteps(
                running=lambda: bool(self._running),
                admit=self._admit,
                drop_cancelled=self._drop_cancelled,
                step=self._step,
                abort_running=self._abort_running,
                fail_running=self._fail_batch,
                release=self._release,
            ),
            name="the embedded engine",
            thread_name="llmrl-engine",
            weight_update=weight_update,
        )
        # Owned by whoever steps the batch (`RequestDriver`):
        self._running: list[RunningSequence] = []  # in the decoder's row order
        self._rows: RowSampling | None = None  # sampling tensors of `_running`; None when stale
        self._draws: list[Callable[[], float]] = []  # each row's uniform draw, rebuilt with `_rows`
        self._adjusted: list[int] = []  # rows with penalties or min_tokens, rebuilt with `_rows`
        self._last_tokens = torch.empty(
            0, dtype=torch.int64
        )  # (rows,) each row's latest token, fed next step
        self._cancellations = False  # set when a request's future is cancelled, from any thread
        self._admission_waited = 0  # steps admissible requests have waited (`_defer_admission`)

    @classmethod
    def from_config(
        cls, config: InferenceConfig, model: ModelConfig, *, seed: int, run_dir: Path | None = None
    ) -> LocalEngine:
        """An engine serving its own copy of `model` (on the GPU when there is one), sized by `config`
        (`run_dir` is unused: the engine writes nothing).

        The trainer keeps its own policy and sends weights with `update_weights`.
        """
        from llmrl.models import load_model

        del run_dir
        device = "cuda" if torch.cuda.is_available() else "cpu"
        served, tokenizer = load_model(
            model.spec,
            dtype=model.dtype,
            device=device,
            # The engine's own decoder attends its KV cache; varlen is the trainer's packed-row kernel.
            attn_implementation="sdpa"
            if model.attn_implementation == "varlen"
            else model.attn_implementation,
            trust_remote_code=model.trust_remote_code,
        )
        return cls(
            served,
            tokenizer,
            max_batch_tokens=config.resolved_max_batch_tokens,
            max_concurrent=config.resolved_max_concurrent,
            weight_update=config.weight_update,
            seed=seed,
            owns_model=True,
            record_routes=config.record_routes,
            cuda_graphs=config.cuda_graphs,
        )

    @property
    def weight_update(self) -> WeightUpdateMode:
        """What `update_weights` does with running sequences (``wait``, ``abort``, ``in_flight``)."""
        return self._requests.weight_update

    @weight_update.setter
    def weight_update(self, mode: WeightUpdateMode) -> None:
        self._requests.weight_update = mode

    @property
    def policy_version(self) -> int:
        """Version of the weights new requests are served with."""
        return self._version

    def health(self) -> Health:
        """The engine runs in this process: there is no server to lose."""
        return Health()

    def close(self) -> None:
        """Nothing to release: the thread that steps the batch ends when the batch is done."""

    @property
    def uses_fast_path(self) -> bool:
        """True when the model runs on the compact Llama/Qwen2 decoder (not the generic fallback)."""
        return isinstance(self._decoder, LlamaFamilyDecoder)

    # -- public API ------------------------------------------------------------------------------

    async def agenerate(self, request: InferenceRequest | dict[str, Any]) -> list[InferenceResponse]:
        """Sample `request.n` completions of one prompt (batched with every other request in flight)."""
        prepared = self._prepare(request)
        self._requests.submit(prepared)  # nobody steps the batch: this event loop will
        # Cancelling this coroutine cancels the future; the driver then drops the request's rows.
        return await asyncio.wrap_future(prepared.future)

    def generate(self, request: InferenceRequest | dict[str, Any]) -> list[InferenceResponse]:
        """Blocking form of `agenerate` (not from inside a running event loop)."""
        return run_sync(self.agenerate(request))

    def prompt_logprobs(self, prompt_ids: list[int], k: int, temperature: float = 1.0) -> PromptLogprobs:
        """`prompt_ids` scored by the served weights (a distillation teacher's view of a sampled sequence):
        each token's logprob after the first, its rank and the `k` likeliest tokens (at most the
        vocabulary) at each position, of the distribution at `temperature` (> 0). Blocks its thread for one
        forward pass of the prompt; the ids must have been checked as a request's prompt."""
        if not temperature > 0:
            raise ValueError(f"temperature: prompt logprobs need a temperature > 0, got {temperature}")
        with self._model_lock, torch.inference_mode():
            logits = self._decoder.prompt_logits(prompt_ids)[:-1]  # (P - 1, V)
        targets = torch.tensor(prompt_ids[1:], device=logits.device)
        k = min(k, logits.shape[-1])
        pieces = []
        # In float64, a chunk of positions at a time: a client takes the rest of the vocabulary's mass as
        # 1 - the top k's, which float32 logprobs would leave with an error of ~1e-7 / its size.
        rows = max(1, PROMPT_LOGPROB_CHUNK // logits.shape[-1])
        for start in range(0, max(logits.shape[0], 1), rows):  # one empty chunk for a one-token prompt
            log_probs = torch.log_softmax(logits[start : start + rows].double() / temperature, dim=-1)
            token = log_probs.gather(-1, targets[start : start + rows, None])[:, 0]
            top = log_probs.topk(k, dim=-1)
            pieces.append((token, (log_probs > token[:, None]).sum(-1) + 1, top.indices, top.values))
        token_logprobs, ranks, top_ids, top_logprobs = (torch.cat(p).cpu() for p in zip(*pieces, strict=True))
        return PromptLogprobs(token_logprobs, ranks, top_ids, top_logprobs)

    def weight_transport(self, kind: PayloadKind) -> WeightTransport[Any]:
        """Whole weights or LoRA adapters into this engine's model (`llmrl.weights.in_process`).

        Whole weights are named as in the model's ``state_dict``; a subset updates only those
        parameters. A send returns once the new weights serve (see the module docstring for
        in-flight sequences). The engine serves whatever version it is given, so `reset` changes
        nothing.

        Buckets are copied into the model one at a time, all between the same two decode steps, by
        the thread that applies the update (the sender's when the engine is idle, else the one
        stepping the batch); the version changes after the last. Each bucket is checked before it
        is copied: one that fails leaves the buckets before it applied (the old version on partly new
        weights, until the next update) and raises to the sender.
        """
        return transport_for(self._transports, kind, "the embedded engine")

    def _apply_update(self, update: WeightUpdate) -> None:
        """Load `update` between two steps (now, when nothing runs) and wait for it."""
        self._requests.between_steps(lambda: self._load(update))

    # -- request preparation (caller's thread) ----------------------------------------------------

    def _prepare(self, request: InferenceRequest | dict[str, Any]) -> PendingRequest:
        if isinstance(request, dict):
            request = InferenceRequest.model_validate(request)
        elif not isinstance(request, InferenceRequest):
            raise ValueError(f"request must be an InferenceRequest or a dict, got {type(request).__name__}")
        args = request.generation_args
        prompt_ids = prompt_token_ids(
            self.tokenizer, request, context=self._decoder.max_positions, vocab_size=self._decoder.vocab_size
        )
        with self._seeding:
            seed = args.seed if args.seed is not None else self._seeds.getrandbits(63)
        future = Future()
        future.add_done_callback(self._note_cancellation)
        return PendingRequest(
            prompt_ids=prompt_ids,
            args=args,
            n=request.n,
            seed=seed,
            stop_ids=(frozenset() if args.ignore_eos else self._eos_ids) | frozenset(args.stop_token_ids),
            future=future,
        )

    def _note_cancellation(self, future: Future) -> None:
        """Done callback of every request's future, in the thread that finished it."""
        if future.cancelled():
            self._cancellations = True

    # -- the primitives the batch is driven with (`RequestDriver`) --------------------------------
    #
    # The batch is stepped by the event loop of the first `agenerate` caller, as a task that runs
    # one step, yields, and ends when there is no work left (the next request starts a new one).
    # Why not a background thread: torch's OpenMP runtime gives each thread that runs parallel
    # ops its own thread pool, and with more pool threads than cores it stops spin-waiting
    # between ops; a decode step is many small ops, so on few cores the same steps run much slower
    # from a second thread than from the main thread (docs/benchmarks.md), which would make the
    # engine slower than `generate`. Steps block their loop for one step at a time.
    # A thread is only the fallback when that loop closes with work left for other callers
    # (`generate` from several threads, each in its own `asyncio.run`).

    def _drop_cancelled(self) -> None:
        """Rows are looked at only after a cancellation (`_note_cancellation`): `Future.cancelled` takes
        a lock, and a step has up to `max_concurrent` requests. Cleared before the scan, so a
        cancellation during it is seen next step."""
        if self._cancellations:
            self._cancellations = False
            cancelled = [row for row, seq in enumerate(self._running) if seq.request.future.cancelled()]
            if cancelled:
                with torch.inference_mode():
                    self._remove_rows(cancelled)

    def _abort_running(self) -> None:
        for seq in self._running:
            seq.finish_reason = "abort"
        with torch.inference_mode():
            self._remove_rows(list(range(len(self._running))))

    def _admit(self, waiting: deque[PendingRequest]) -> list[PendingRequest]:
        """The waiting requests that fit the batch, first come first served (`_defer_admission`)."""
        admitted: list[PendingRequest] = []
        rows, tokens = len(self._running), self._cache_tokens()
        while waiting:
            request = waiting[0]
            if request.future.cancelled():
                waiting.popleft()
                continue
            rows += request.n
            tokens += len(request.prompt_ids) + request.n
            if (self._running or admitted) and (rows > self.max_concurrent or tokens > self.max_batch_tokens):
                break
            admitted.append(waiting.popleft())
        if admitted and self._defer_admission(admitted, waiting):
            waiting.extendleft(reversed(admitted))
            return []
        return admitted

    def _release(self) -> None:
        """An empty batch: on GPU the KV cache is freed while idle."""
        with torch.inference_mode():
            self._decoder.reset()

    def _defer_admission(self, admissible: list[PendingRequest], waiting: deque[PendingRequest]) -> bool:
        """Whether `admissible` (the waiting requests that fit now) should wait for more room.

        A prefill of a few prompts costs about as much as a decode step of the whole batch, so
        when the batch is full and requests queue, admitting each row the moment one leaves
        would add a prefill to most steps. While some waiting request does not fit yet, the ones
        that do wait until they bring `ADMIT_AT_LEAST` of `max_concurrent` rows, or for at most
        `ADMISSION_WAIT` steps.
        """
        queue_fits = not waiting
        rows = sum(r.n for r in admissible)
        if (
            not self._running
            or queue_fits
            or rows >= self.ADMIT_AT_LEAST * self.max_concurrent
            or self._admission_waited >= self.ADMISSION_WAIT
        ):
            self._admission_waited = 0
            return False
        self._admission_waited += 1
        return True

    def _cache_tokens(self) -> int:
        """KV-cache tokens of the running batch: each request's prompt once, plus every generated token."""
        prompts = sum(len(r.prompt_ids) for r in {seq.request for seq in self._running})
        return prompts + sum(len(seq.tokens) for seq in self._running)

    def _load(self, update: WeightUpdate) -> None:
        with self._model_lock, torch.inference_mode(False):
            load = self._decoder.merge_deltas if update.merge else self._decoder.load_state_dict
            for bucket in update.buckets:
                load(bucket)
        self._version = update.version

    def _step(self, admitted: list[PendingRequest]) -> None:
        """One engine iteration: decode the running rows, prefill the admitted requests, sample all."""
        with self._model_lock, torch.inference_mode():
            self._sample_next(admitted)

    def _sample_next(self, admitted: list[PendingRequest]) -> None:
        if (
            self._version > self._stepped_version
        ):  # loaded in flight: the rows' next tokens are the new version's
            for seq in self._running:
                seq.version_changes.append((len(seq.tokens), self._version))
        self._stepped_version = self._version
        logits = []
        if self._running:
            self.stats.decode_tokens += len(self._running)
            with self._recording():
                logits.append(self._decoder.decode(self._last_tokens))
            if self._routes is not None:
                for seq, route in zip(self._running, self._routes.take(), strict=True):
                    seq.routes.append(route)
        if admitted:
            with self._recording():
                prompt_logits = self._decoder.prefill(
                    [r.prompt_ids for r in admitted],
                    [r.n for r in admitted],
                    [r.args.max_tokens for r in admitted],
                )
            if self._routes is not None:
                prompt_routes = self._routes.take().split([len(r.prompt_ids) for r in admitted])
                for request, routes in zip(admitted, prompt_routes, strict=True):
                    request.prompt_routes = routes
            if any(r.n > 1 for r in admitted):
                counts = torch.tensor([r.n for r in admitted], device=self._device)
                prompt_logits = prompt_logits.repeat_interleave(counts, dim=0)
            logits.append(prompt_logits)
            for request in admitted:
                self._start(request)
            self.stats.prefill_tokens += sum(len(r.prompt_ids) for r in admitted)
            self._rows = None
        self.stats.steps += 1
        if self._rows is None:
            self._rows = row_sampling(
                [seq.request.args for seq in self._running], self._decoder.vocab_size, self._device
            )
            self._draws = [_no_draw if seq.rng is None else seq.rng.random for seq in self._running]
            self._adjusted = [
                row for row, seq in enumerate(self._running) if adjusts_logits(seq.request.args)
            ]
        # A double just below 1 rounds to 1.0 in float32: clamped after the conversion.
        uniforms = list_tensor([draw() for draw in self._draws], torch.float32, self._device).clamp_(
            max=MAX_UNIFORM
        )
        logits = torch.cat(logits) if len(logits) > 1 else logits[0]
        if self._adjusted:
            logits = penalized(logits, self._running, self._adjusted)
        tokens, logprobs = sample_tokens(logits, self._rows, uniforms)
        self._last_tokens = tokens
        finished = []
        for row, (seq, token, logprob) in enumerate(
            zip(self._running, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if seq.seen is not None:
                seq.seen[token] = seq.seen_in_completion[token] = True
            reason = finish_reason(seq, token, self.tokenizer, self._backend)
            if reason is not None:
                seq.finish_reason = reason
                finished.append(row)
        self.stats.completion_tokens += len(self._running)
        self.stats.peak_cache_bytes = max(self.stats.peak_cache_bytes, self._decoder.cache_bytes)
        if finished:
            self._remove_rows(finished)

    def _recording(self) -> contextlib.AbstractContextManager:
        """Where the decoder's forwards run: under the route recorder when the engine records routes."""
        return contextlib.nullcontext() if self._routes is None else self._routes

    def _start(self, request: PendingRequest) -> None:
        """Create the request's sequences (rows were appended by the decoder's prefill)."""
        request.policy_version = self._version
        request.unfinished = request.n
        sampled = request.args.temperature > 0.0
        for index in range(request.n):
            seq = RunningSequence(request, random.Random(f"{request.seed}/{index}") if sampled else None)
            if request.args.stop and self._backend is not None:
                seq.stream = DecodeStream(skip_special_tokens=True)
            if adjusts_logits(request.args):
                seq.seen = torch.zeros(self._decoder.vocab_size, dtype=torch.bool, device=self._device)
                seq.seen[request.prompt_ids] = True
                seq.seen_in_completion = torch.zeros_like(seq.seen)
            request.sequences.append(seq)
            self._running.append(seq)

    def _remove_rows(self, rows: list[int]) -> None:
        """Take `rows` out of the batch; resolve the requests whose last sequence just ended."""
        leaving = [self._running[row] for row in rows]
        order = self._decoder.remove_rows(rows)
        self._running = [self._running[i] for i in order]
        if self._running:
            self._last_tokens = self._last_tokens[list_tensor(order, torch.int64, self._device)]
        self._rows = None
        for seq in leaving:
            request = seq.request
            request.unfinished -= 1
            if request.unfinished == 0 and not request.future.done():
                request.future.set_result([response(s, self.tokenizer) for s in request.sequences])

    def _fail_batch(self, admitted: list[PendingRequest], exc: Exception) -> None:
        """A step raised: fail every request in the batch with `exc` and start again from an empty cache."""
        requests = {seq.request for seq in self._running} | set(admitted)
        for request in requests:
            if not request.future.done():
                request.future.set_exception(exc)
        self._running = []
        self._rows = None
        self._decoder.reset()


def _no_draw() -> float:
    """The uniform of a greedy row, which draws nothing."""
    return 0.0


def _default_eos_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    ids = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.append(generation_eos)
    elif generation_eos:
        ids.extend(generation_eos)
    return ids
