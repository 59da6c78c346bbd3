"""ColocatedVLLM: vLLM's engine inside the trainer's process (`inference.vllm.mode: colocate`).

The engine is vLLM's `LLMEngine` with its core in this process (no engine process, no HTTP): one
thread, the driver's (`llmrl.inference.driver`, as the embedded engine's), owns it and does everything
that touches it, in order: it admits the requests that `agenerate` queues (each rendered into token ids
here, as the embedded engine renders it, so vLLM never tokenises a conversation again), steps the
engine while any run, and answers each request when vLLM finishes it. A weight sync is work for the
same thread, between two steps: ``inference.weight_update: wait`` first lets running requests finish on
the old weights (new ones wait), ``abort`` ends them at once (``finish_reason: abort``). The sync itself hands the trainer's tensors
to llmrl's transfer backend inside vLLM's worker through vLLM's own weight-update calls, which in
this process pass Python objects by reference: the backend checks every tensor (name, shape, finite
values) and copies it into vLLM's weights only once the whole update has arrived and passed.

On CUDA the engine can sleep while the trainer updates (`sleep_level`): `ColocatedWeights.before_update`
puts it to sleep, the next sync wakes its weights, loads the new ones, then wakes its KV cache.
vLLM's sleep mode exists on CUDA only.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import logging
import os
import random
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from llmrl.config import ConfigError, InferenceConfig, ModelConfig, VLLMConfig
from llmrl.inference.completions import parse_finish_reason
from llmrl.inference.driver import EngineSteps, RequestDriver, settle
from llmrl.inference.interface import Health, InferenceInterface, run_sync
from llmrl.inference.prompts import prompt_token_ids
from llmrl.inference.vllm.compatibility import vllm_pause_mode
from llmrl.inference.vllm.routed_experts import refuse_router_replay
from llmrl.models.shape import tied_duplicates
from llmrl.types import MAX_POLICY_VERSION, InferenceRequest, InferenceResponse
from llmrl.weights import (
    AdapterWeights,
    FullWeights,
    PayloadKind,
    WeightSyncError,
    WeightTransport,
    check_version,
    served_tensors,
    transport_for,
)

log = logging.getLogger(__name__)

_SEED_RANGE = 2**31 - 1


@dataclass(eq=False)
class _Request:
    """A request from its `agenerate` call until vLLM finishes it."""

    request: InferenceRequest
    prompt_ids: list[int]
    future: Future[list[InferenceResponse]]
    version: int = 0  # of the weights it runs on, set when it is admitted


class ColocatedVLLM(InferenceInterface):
    """`InferenceInterface` on a vLLM engine in this process, weights synced in memory."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        config: VLLMConfig,
        seed: int | None = None,
        policy_version: int = 0,
        base_model: torch.nn.Module | None = None,
        pause_mode: Literal["wait", "abort"] = "wait",
    ):
        """
        Args:
            engine: a vLLM `LLMEngine` whose core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`),
                started with llmrl's transfer backend (`from_config` builds one).
            tokenizer: the model's tokenizer, which renders every prompt into token ids.
            config: the vLLM section (`sleep_level`).
            seed: seeds the generator that gives each request without a seed its own (None: from the OS).
            policy_version: version stamped on responses until the first sync.
            base_model: the model LoRA adapters adapt, whose weights they are merged onto
                (`ColocatedAdapters`); None: the engine takes whole weights only.
            pause_mode: what a sync does with running requests: ``wait`` until they finish, or
                ``abort`` them.
        """
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.transport = ColocatedWeights(self)
        self.transports: list[WeightTransport[Any]] = [self.transport]
        if base_model is not None:
            self.transports.append(ColocatedAdapters(self.transport, base_model))
        self._version = policy_version
        self._seeds = random.Random(seed)
        self._seeding = threading.Lock()
        self._ids = itertools.count()
        self._running: dict[str, _Request] = {}  # the driver's alone
        self.sleeping = False  # the driver's alone
        self._requests = RequestDriver(
            EngineSteps(
                running=lambda: bool(self._running),
                step=self._step,  # vLLM schedules: every queued request joins at the next step
                abort_running=self._abort_running,
                fail_running=self._fail_running,
            ),
            name="the colocated vLLM engine",
            thread_name="colocated-vllm",
            weight_update=pause_mode,
            own_thread=True,
        )

    @classmethod
    def from_config(
        cls, config: InferenceConfig, model: ModelConfig, *, seed: int, run_dir: Path | None = None
    ) -> ColocatedVLLM:
        """An engine of `model` in this process, on this process's GPU (or the CPU build's cores).
        Under torchrun every process starts one at the same time (vLLM sets up its groups in the
        trainer's process group); `llmrl.inference.vllm.ranks` joins them to serve rank 0."""
        from llmrl.models import load_model, load_tokenizer

        vllm = config.vllm
        check_colocatable(vllm)
        if config.record_routes:
            refuse_router_replay(sys.executable)
        served = _shared_served_path(model, run_dir)
        # LoRA: the frozen base the trainer's adapters adapt, loaded as the trainer loads it.
        base_model = None
        if model.lora is not None:
            base_model, _ = load_model(
                model.spec, dtype=model.dtype, trust_remote_code=model.trust_remote_code
            )
        engine = start_engine(
            served, model.dtype, vllm, seed=seed, max_concurrent=config.resolved_max_concurrent
        )
        tokenizer = load_tokenizer(model.spec, trust_remote_code=model.trust_remote_code)
        return cls(
            engine,
            tokenizer,
            config=vllm,
            seed=seed,
            base_model=base_model,
            pause_mode=vllm_pause_mode(config),
        )

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def pause_mode(self) -> Literal["wait", "abort"]:
        """What a sync does with running requests (``wait``, ``abort``), from the next sync on."""
        return self._requests.weight_update

    @pause_mode.setter
    def pause_mode(self, mode: Literal["wait", "abort"]) -> None:
        self._requests.weight_update = mode

    def health(self) -> Health:
        return Health(servers=("vLLM in this process",))

    # -- generation ------------------------------------------------------------------------------

    async def agenerate(self, request: InferenceRequest | dict[str, Any]) -> list[InferenceResponse]:
        """Sample `request.n` completions; `ValueError` for a request that does not fit (`submit`)."""
        return await asyncio.wrap_future(self.submit(request))

    def generate(self, request: InferenceRequest | dict[str, Any]) -> list[InferenceResponse]:
        """Blocking form of `agenerate`."""
        return run_sync(self.agenerate(request))

    def submit(self, request: InferenceRequest | dict[str, Any]) -> Future[list[InferenceResponse]]:
        """Queue `request` for the driver; the future holds its responses. `ValueError` for a prompt
        that leaves no room for `max_tokens` in the engine's `max_model_len` (vLLM would cut it short)."""
        if isinstance(request, dict):
            request = InferenceRequest.model_validate(request)
        with self._seeding:
            request = with_seed(request, self._seeds)
        model = self.engine.model_config
        prompt_ids = prompt_token_ids(
            self.tokenizer, request, context=model.max_model_len, vocab_size=model.get_vocab_size()
        )
        pending = _Request(request, prompt_ids, Future())
        self._requests.submit(pending)
        return pending.future

    # -- weights ---------------------------------------------------------------------------------

    def weight_transport(self, kind: PayloadKind) -> WeightTransport[Any]:
        """Whole weights, handed over in memory (`ColocatedWeights`); with base weights, LoRA
        adapters merged onto them (`ColocatedAdapters`)."""
        return transport_for(self.transports, kind, "vLLM colocated in this process")

    def between_steps(self, run: Callable[[], Any]) -> Any:
        """Run `run` on the driver between two engine steps, once no request runs (`pause_mode` wait)
        or after ending those that do (abort), and return its result."""
        return self._requests.between_steps(run)

    def set_version(self, version: int) -> None:
        """Stamp later admissions with `version` (the driver calls it, after a sync)."""
        self._version = version

    # -- the driver's primitives (`RequestDriver`) -----------------------------------------------

    def _admit(self, pending: _Request) -> None:
        from vllm import SamplingParams

        if pending.future.cancelled():
            return
        if self.sleeping:
            self.wake_up()
        request_id = f"llmrl-{next(self._ids)}"
        pending.version = self._version
        try:
            params = SamplingParams(**sampling_options(pending.request))
            self.engine.add_request(request_id, {"prompt_token_ids": pending.prompt_ids}, params)
        except Exception as exc:  # vLLM refuses the request (too long, bad options): only its caller fails
            pending.future.set_exception(ValueError(f"vLLM refused the request: {exc}"))
            return
        self._running[request_id] = pending  # vLLM's outputs carry this id (its own adds a suffix)

    def _step(self, admitted: list[_Request]) -> None:
        for pending in admitted:
            self._admit(pending)
        if not self._running:
            return
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("colocated vLLM failed a step; its requests fail")
            raise
        for output in outputs:
            if output.finished and output.request_id in self._running:
                pending = self._running.pop(output.request_id)
                settle(pending.future, lambda p=pending, o=output: responses(p, o, self.tokenizer))

    def _abort_running(self) -> None:
        self.engine.abort_request(list(self._running), internal=False)
        for request_id in list(self._running):
            self._finish_aborted(request_id)

    def _finish_aborted(self, request_id: str) -> None:
        pending = self._running.pop(request_id)
        aborted = InferenceResponse(
            text="",
            prompt_token_ids=pending.prompt_ids,
            token_ids=[],
            logprobs=[],
            finish_reason="abort",
            policy_version=pending.version,
        )
        pending.future.set_result([aborted] * pending.request.n)

    def _fail_running(self, admitted: list[_Request], error: Exception) -> None:
        running, self._running = self._running, {}
        if running:
            try:
                self.engine.abort_request(list(running), internal=False)
            except Exception:  # noqa: BLE001 (the engine failed already; the callers hear of the first error)
                log.debug("aborting after a failed step failed too", exc_info=True)
        for pending in [*running.values(), *admitted]:
            if not pending.future.done():
                pending.future.set_exception(error)

    # -- sleep (CUDA) ----------------------------------------------------------------------------

    def sleep(self) -> None:
        """Release the engine's memory (`sleep_level`); the driver calls it with no request running."""
        if self.config.sleep_level and not self.sleeping:
            self.engine.sleep(level=self.config.sleep_level)
            self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of `tags` ("weights", "kv_cache"; None: all) after `sleep`."""
        if self.sleeping:
            self.sleeping = not self.engine.wake_up(tags)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the driver (requests still queued fail) and shut the engine down."""
        if not self._requests.close():
            return
        shutdown = getattr(self.engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> ColocatedVLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ColocatedWeights(WeightTransport[FullWeights]):
    """Whole weights into the colocated engine: the trainer's tensors, by reference, bucket by bucket
    to llmrl's transfer backend in vLLM's worker, which checks them all before it loads any."""

    takes = ("weights",)
    same_device = True

    def __init__(self, owner: ColocatedVLLM):
        self.owner = owner

    def before_update(self) -> None:
        """The trainer is about to update the policy: with `sleep_level`, the engine sleeps until the
        next `send` (requests running then finish first)."""
        if self.owner.config.sleep_level:
            self.owner.between_steps(self.owner.sleep)

    def send(self, payload: FullWeights, version: int, *, reset: bool = False) -> None:
        check_version(version, MAX_POLICY_VERSION)
        self.owner.between_steps(lambda: self._load(payload.buckets(), version))

    def _load(self, buckets: Iterator[dict[str, torch.Tensor]], version: int) -> None:
        owner, engine = self.owner, self.owner.engine
        owner.wake_up(["weights"])
        try:
            engine.collective_rpc("start_weight_update")
            for bucket in buckets:
                engine.collective_rpc("update_weights", args=({"names": list(bucket), "tensors": bucket},))
            engine.collective_rpc("finish_weight_update")
        except Exception as exc:
            engine.collective_rpc("llmrl_abandon_weight_update")
            raise WeightSyncError(f"weight sync to the colocated vLLM engine failed: {exc}") from exc
        # Cached prefixes hold keys and values of the old weights.
        engine.reset_prefix_cache()
        owner.wake_up(["kv_cache"])
        owner.set_version(version)


class ColocatedAdapters(WeightTransport[AdapterWeights]):
    """LoRA adapters into the colocated engine as whole weights: the base plus each adapter's delta,
    sent through `ColocatedWeights`. vLLM 0.32's LoRA manager loads adapters from files alone; in
    this process a merge costs less than a file, and the engine then serves plain weights (no LoRA
    kernels, no adapter slots)."""

    takes = ("adapters",)

    def __init__(self, weights: ColocatedWeights, base_model: torch.nn.Module):
        self.weights = weights
        self.served = served_tensors(base_model)
        tied = tied_duplicates(base_model)  # a checkpoint holds a tied LM head's tensor once
        self.base = {name: tensor for name, tensor in base_model.state_dict().items() if name not in tied}

    def before_update(self) -> None:
        self.weights.before_update()

    def send(self, payload: AdapterWeights, version: int, *, reset: bool = False) -> None:
        payload.check(self.served)
        merged = dict(self.base)
        for layer in payload.deltas():
            for name, delta in layer.items():
                merged[name] = (self.base[name].float() + delta).to(self.base[name].dtype)
        self.weights.send(FullWeights.of(merged), version, reset=reset)


def sampling_options(request: InferenceRequest) -> dict[str, Any]:
    """vLLM `SamplingParams` keyword arguments of `request`: the sampled token's logprob with each
    token, final outputs only, the request's sampling options as the managed servers get them."""
    from vllm.sampling_params import RequestOutputKind

    args = request.generation_args
    return dict(
        n=request.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k or -1,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos,
        max_tokens=args.max_tokens,
        stop=list(args.stop),
        stop_token_ids=list(args.stop_token_ids),
        seed=args.seed,
        logprobs=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
        # vLLM detokenises every step, which only stop strings need (a quarter of a demo batch's time
        # on the CPU build); without them the text is decoded once, at the end (`responses`).
        detokenize=bool(args.stop),
    )


def responses(pending: _Request, output: Any, tokenizer: Any) -> list[InferenceResponse]:
    """The `InferenceResponse` of each of vLLM's completions of a request, in sample order."""
    result = []
    detokenized = bool(pending.request.generation_args.stop)
    for completion in sorted(output.outputs, key=lambda c: c.index):
        token_ids = list(completion.token_ids)
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs or [], token_ids, strict=True)
        ]
        result.append(
            InferenceResponse(
                text=completion.text
                if detokenized
                else tokenizer.decode(token_ids, skip_special_tokens=True),
                prompt_token_ids=pending.prompt_ids,
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=parse_finish_reason(completion.finish_reason),
                policy_version=pending.version,
            )
        )
    return result


def with_seed(request: InferenceRequest, seeds: random.Random) -> InferenceRequest:
    """`request`, with a seed drawn from `seeds` when it carries none: vLLM gives a seeded request the
    same tokens whatever it is batched with, in whichever engine serves it."""
    if request.generation_args.seed is not None:
        return request
    args = request.generation_args.model_copy(update={"seed": seeds.randrange(_SEED_RANGE)})
    return request.model_copy(update={"generation_args": args})


def check_colocatable(config: VLLMConfig) -> None:
    """What a colocated engine needs from this process: vllm and, to sleep, CUDA."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "inference.vllm.mode: colocate runs vLLM in the trainer's process, and this Python has no vllm: "
            "run with the interpreter of `bash scripts/setup.sh vllm` (.venv-vllm/bin/python); `llmrl train` "
            "switches to it by itself"
        )
    if config.sleep_level and not torch.cuda.is_available():
        raise ConfigError(
            f"inference.vllm.sleep_level: {config.sleep_level} needs CUDA (vLLM's sleep mode); set 0 on this machine"
        )


def _shared_served_path(model: ModelConfig, run_dir: Path | None) -> str:
    """What the engine loads (`served_model_path`). Under torchrun transformers writes a model folder
    on rank 0 alone, so the other processes load the one rank 0 wrote (one host, or a shared disk)."""
    from llmrl.inference.vllm.server import served_model_path, temporary_folder

    processes = world_size()
    served = None
    if processes == 1 or torch.distributed.get_rank() == 0:
        folder = Path(run_dir) / "vllm" if run_dir is not None else Path(temporary_folder())
        served = served_model_path(model, folder / "model")
    if processes == 1:
        return served
    holder = [served]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def world_size() -> int:
    """Processes of this run (torchrun's ``WORLD_SIZE``; 1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def start_engine(model: str, dtype: str, config: VLLMConfig, *, seed: int, max_concurrent: int) -> Any:
    """vLLM's `LLMEngine` of `model` (a folder or hub id) with its core in this process, serving
    processed logprobs (those of the distribution sampled from), decoding up to `max_concurrent`
    sequences at once and taking weights from llmrl's transfer backend."""
    # Read by vLLM when the engine starts: its core and the CPU build's KV cache; `env` last, as for a
    # managed server.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_gib)
    os.environ.update(config.env)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from llmrl.inference.vllm.server import EXTENSION_CLASS
    from llmrl.weights import TRANSFER_BACKEND

    cuda = torch.cuda.is_available()
    engine_args = EngineArgs(
        model=model,
        dtype=dtype,  # vLLM's "auto" serves float32 checkpoints in reduced precision on its CPU build
        seed=seed,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=EXTENSION_CLASS,
        weight_transfer_config={"backend": TRANSFER_BACKEND},
        max_model_len=config.max_model_len,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enable_sleep_mode=bool(config.sleep_level),
        max_num_seqs=max_concurrent,
        # vLLM-CPU 0.32 kills its engine when a seeded request's prefill is split over steps.
        enable_chunked_prefill=cuda,
        # Under torchrun every process starts its own engine on its own device, in the trainer's
        # process group (vLLM's name for that is an external launcher); alone, vLLM sets up its own.
        distributed_executor_backend="external_launcher" if world_size() > 1 else None,
    )
    return LLMEngine.from_engine_args(engine_args)


__all__ = [
    "ColocatedAdapters",
    "ColocatedVLLM",
    "ColocatedWeights",
    "check_colocatable",
    "sampling_options",
    "start_engine",
]
