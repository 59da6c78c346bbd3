"""The state `llmrl serve-tinker` serves: sessions, LoRA training clients over base models, samplers and
futures, and the model work each call does (docs/tinker.md)."""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi.responses import JSONResponse, Response
from tinker import types

from llmrl.algorithms.logprobs import token_logprobs
from llmrl.algorithms.packing import build_batch, pack, unpack
from llmrl.inference.engine import LocalEngine
from llmrl.inference.kv_cache import max_positions
from llmrl.server.tinker.losses import tinker_loss
from llmrl.server.tinker.wire import PROTOBUF, ForwardBackwardCall, Refused, forward_backward_output

log = logging.getLogger(__name__)

RETRIEVE_WAIT_S = 20.0
"""How long ``retrieve_future`` holds a poll open before answering ``try_again`` (the SDK waits 45 s)."""
PACKED_ROW_TOKENS = 4096
"""Tokens per packed row of a ``forward_backward`` batch (a longer datum gets a row of its own)."""

# Tinker's LoRA switches, as the module names of the Llama/Qwen2 families llmrl serves.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
LORA_ALPHA = 32.0


@dataclass
class TrainedModel:
    """One training client: a LoRA adapter over its own copy of a base model, and its AdamW."""

    model_id: str
    base_model: str
    rank: int
    peft_model: Any
    tokenizer: Any
    optimizer: torch.optim.AdamW

    @property
    def config(self) -> Any:
        return self.peft_model.get_base_model().config


@dataclass
class Sampler:
    """A sampling session: an engine serving a snapshot of an adapter merged into its base."""

    base_model: str
    engine: LocalEngine


@dataclass
class TinkerService:
    """The server's state: the base models it may train, sessions, trained models, samplers, futures."""

    base_specs: list[str]
    lora_rank_max: int
    device: str
    seed: int = 0
    sessions: set[str] = field(default_factory=set)
    models: dict[str, TrainedModel] = field(default_factory=dict)
    samplers: dict[str, Sampler] = field(default_factory=dict)
    futures: dict[str, asyncio.Future] = field(default_factory=dict)
    _bases: dict[str, tuple[torch.nn.Module, Any]] = field(default_factory=dict)
    _worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmrl-tinker")
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- futures ---------------------------------------------------------------------------------

    def submit(self, work: Callable[[], Any], model_id: str | None = None) -> dict[str, Any]:
        """Queue `work` on the worker (model work runs one call at a time, in arrival order)."""
        request_id = uuid.uuid4().hex
        self.futures[request_id] = asyncio.get_running_loop().run_in_executor(self._worker, work)
        return types.UntypedAPIFuture(request_id=request_id, model_id=model_id).model_dump(exclude_none=True)

    async def retrieve(self, request_id: str) -> Response:
        future = self.futures.get(request_id)
        if future is None:
            raise Refused(404, f"request_id: no future {request_id!r} on this server")
        try:
            result = await asyncio.wait_for(asyncio.shield(future), RETRIEVE_WAIT_S)
        except TimeoutError:
            pending = types.TryAgainResponse(request_id=request_id, queue_state="active")
            return JSONResponse(pending.model_dump(mode="json"))
        except Refused as exc:
            failed = types.RequestFailedResponse(error=exc.message, category=types.RequestErrorCategory.User)
            return JSONResponse(failed.model_dump(mode="json"))
        except Exception as exc:
            log.exception("request %s failed", request_id)
            failed = types.RequestFailedResponse(
                error=f"{type(exc).__name__}: {exc}", category=types.RequestErrorCategory.Server
            )
            return JSONResponse(failed.model_dump(mode="json"))
        if isinstance(result, bytes):
            return Response(result, media_type=PROTOBUF)
        return JSONResponse(result.model_dump(mode="json", exclude_none=True))

    # -- models ----------------------------------------------------------------------------------

    def capabilities(self) -> types.GetServerCapabilitiesResponse:
        return types.GetServerCapabilitiesResponse(
            supported_models=[
                types.SupportedModel(model_name=spec, trainable=True, sampleable=True)
                for spec in self.base_specs
            ]
        )

    def check_new_model(self, request: types.CreateModelRequest) -> None:
        """Refuse what `create_model` cannot do before a future is made for it."""
        self.check_session(request.session_id)
        if request.base_model not in self.base_specs:
            raise Refused(
                400, f"base_model: {request.base_model!r} is not served here (served: {self.base_specs})"
            )
        lora = request.lora_config
        if lora is None:
            raise Refused(400, "lora_config: required (full fine-tuning is not served)")
        if not 1 <= lora.rank <= self.lora_rank_max:
            raise Refused(400, f"lora_config.rank: must be in 1..{self.lora_rank_max}, got {lora.rank}")
        if not isinstance(request.optimizer_config, types.AdamOptimizerConfig):
            raise Refused(
                400, f"optimizer_config: only adamw is served, got {request.optimizer_config.type!r}"
            )

    def create_model(self, request: types.CreateModelRequest) -> types.CreateModelResponse:
        import peft

        lora = request.lora_config
        assert lora is not None
        base, tokenizer = self.load_base(request.base_model)
        model = copy.deepcopy(base)
        targets = [
            *(ATTENTION_MODULES if lora.train_attn else ()),
            *(MLP_MODULES if lora.train_mlp else ()),
            *(UNEMBED_MODULES if lora.train_unembed else ()),
        ]
        if lora.train_unembed and model.config.tie_word_embeddings:
            # The head's adapter must not reach the input embedding when it is merged for sampling.
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
            model.config.tie_word_embeddings = False
        config = peft.LoraConfig(
            r=lora.rank, lora_alpha=LORA_ALPHA, target_modules=targets, task_type="CAUSAL_LM"
        )
        # peft draws A from torch's global generator: the seed makes the adapter reproducible.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed if lora.seed is None else lora.seed)
            peft_model = peft.get_peft_model(model, config)
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        for parameter in trainable:
            parameter.data = parameter.data.float()
        model_id = f"{request.session_id}:train:{request.model_seq_id}"
        optimizer = torch.optim.AdamW(trainable, lr=types.AdamParams().learning_rate)
        with self._lock:
            self.models[model_id] = TrainedModel(
                model_id, request.base_model, lora.rank, peft_model, tokenizer, optimizer
            )
        return types.CreateModelResponse(model_id=model_id)

    def load_base(self, spec: str) -> tuple[torch.nn.Module, Any]:
        """The base model of `spec`, loaded once; each trained model deep-copies it."""
        if spec not in self._bases:
            from llmrl.models import load_model

            model, tokenizer = load_model(spec, device=self.device)
            for parameter in model.parameters():
                parameter.requires_grad_(False)
            self._bases[spec] = (model, tokenizer)
        return self._bases[spec]

    def model(self, model_id: str) -> TrainedModel:
        trained = self.models.get(model_id)
        if trained is None:
            raise Refused(404, f"model_id: no training client {model_id!r} on this server")
        return trained

    def limits(self, model_id: str) -> tuple[int, int]:
        """The vocabulary size and positions of a training client's model."""
        config = self.model(model_id).config
        return int(config.vocab_size), max_positions(config)

    def info(self, model_id: str) -> types.GetInfoResponse:
        trained = self.model(model_id)
        return types.GetInfoResponse(
            model_id=model_id,
            model_data=types.ModelData(model_name=trained.base_model),
            is_lora=True,
            lora_rank=trained.rank,
            model_name=trained.base_model,
        )

    def check_session(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise Refused(404, f"session_id: no session {session_id!r} on this server")

    # -- training --------------------------------------------------------------------------------

    def forward_backward(self, trained: TrainedModel, call: ForwardBackwardCall) -> bytes:
        """The loss `call` names over its data (`llmrl.server.tinker.losses`); the gradient adds to what
        earlier calls left until `optim_step`. Answers the SDK's protobuf ``ForwardBackwardOutput`` with
        each datum's target logprobs and the ``loss:sum`` metric."""
        # Targets are the inputs shifted by one, so datum i is the sequence tokens + [last target]:
        # llmrl's packed logprobs of its tokens 1.. are the targets' logprobs.
        sequences = [datum.tokens + datum.targets[-1:] for datum in call.data]
        lengths = [len(sequence) for sequence in sequences]
        bins = pack(lengths, max_tokens=max(PACKED_ROW_TOKENS, *lengths))
        batch = build_batch(sequences, bins, pad_token_id=trained.tokenizer.pad_token_id or 0).to(self.device)
        model = trained.peft_model.get_base_model()
        with torch.set_grad_enabled(not call.forward_only):
            logprobs, _ = token_logprobs(model, batch)
            per_datum = unpack(logprobs, batch)
            target_logprobs = [per_datum[i][1:] for i in range(len(call.data))]
            inputs = [{name: values.to(self.device) for name, values in d.inputs.items()} for d in call.data]
            loss = tinker_loss(call.loss, target_logprobs, inputs)
            if not call.forward_only:
                loss.backward()
        return forward_backward_output(
            [values.detach().float().cpu().numpy() for values in target_logprobs], float(loss.detach())
        )

    def optim_step(self, trained: TrainedModel, params: types.AdamParams) -> types.OptimStepResponse:
        """One AdamW step with this call's hyperparameters (Tinker's: decoupled weight decay, optional
        clipping of the global gradient norm); the gradients are then cleared."""
        trainable = [p for group in trained.optimizer.param_groups for p in group["params"]]
        metrics: dict[str, float] = {}
        if params.grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(trainable, params.grad_clip_norm)
            metrics["grad_norm:mean"] = float(norm)
        for group in trained.optimizer.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        trained.optimizer.step()
        trained.optimizer.zero_grad(set_to_none=True)
        return types.OptimStepResponse(metrics=metrics)

    # -- sampling --------------------------------------------------------------------------------

    def save_for_sampler(
        self, trained: TrainedModel, request: types.SaveWeightsForSamplerRequest
    ) -> types.SaveWeightsForSamplerResponseInternal:
        """A snapshot of the adapter merged into a copy of its base, served by an engine of its own."""
        merged = copy.deepcopy(trained.peft_model).merge_and_unload()
        engine = LocalEngine(merged, trained.tokenizer, seed=self.seed, owns_model=True)
        session_id = trained.model_id.split(":train:")[0]
        sampler_id = f"{session_id}:sample:{request.sampling_session_seq_id}"
        with self._lock:
            self.samplers[sampler_id] = Sampler(trained.base_model, engine)
        return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id)

    def sampler(self, sampler_id: str | None) -> Sampler:
        sampler = self.samplers.get(sampler_id or "")
        if sampler is None:
            raise Refused(404, f"sampling_session_id: no sampler {sampler_id!r} on this server")
        return sampler

    def finish_session(self, session_id: str) -> None:
        """The session's models and samplers are released: its client closed it."""
        self.sessions.discard(session_id)
        prefix = f"{session_id}:"
        with self._lock:
            for model_id in [m for m in self.models if m.startswith(prefix)]:
                del self.models[model_id]
            finished = [s for s in self.samplers if s.startswith(prefix)]
            engines = [self.samplers.pop(sampler_id).engine for sampler_id in finished]
        for engine in engines:
            engine.close()

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        for sampler in self.samplers.values():
            sampler.engine.close()
