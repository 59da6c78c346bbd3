"""The state `llmrl serve-tinker` serves: sessions, LoRA training clients over base models, samplers and
futures, and the model work each call does (docs/tinker.md)."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import re
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from fastapi.responses import JSONResponse, Response
from tinker import types

from llmrl.algorithms.logprobs import token_logprobs
from llmrl.algorithms.packing import build_batch, pack, unpack
from llmrl.config import TrainingConfig
from llmrl.inference.engine import LocalEngine
from llmrl.inference.kv_cache import max_positions
from llmrl.server.tinker.checkpoints import (
    AdapterRecord,
    CheckpointPath,
    adapter_record,
    checkpoint_folder,
    list_checkpoints,
    load_adapter,
    load_optimizer,
    save_checkpoint,
)
from llmrl.server.tinker.losses import tinker_loss
from llmrl.server.tinker.wire import PROTOBUF, ForwardBackwardCall, Refused, forward_backward_output

log = logging.getLogger(__name__)

RETRIEVE_WAIT_S = 20.0
"""How long ``retrieve_future`` holds a poll open before answering ``try_again`` (the SDK waits 45 s)."""
FUTURE_KEEP_S = 600.0
"""How long a finished future stays retrievable after its result was first answered (a client that lost
the answer asks again at once; nothing asks ten minutes later)."""
PACKED_ROW_TOKENS = TrainingConfig.model_fields["pack_row_tokens"].default
"""Tokens per packed row of a ``forward_backward`` batch, as `llmrl train` packs them (a longer datum gets
a row of its own): attention's cost grows with the row, so short rows suit many short data."""

# Tinker's LoRA switches, as the module names of the Llama/Qwen2 families llmrl serves.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
LORA_ALPHA = 32.0


@dataclass
class TrainedModel:
    """One training client: a LoRA adapter over its own copy of a base model, and its AdamW."""

    model_id: str
    adapter: AdapterRecord
    peft_model: Any
    tokenizer: Any
    optimizer: torch.optim.AdamW
    last_request: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def config(self) -> Any:
        return self.peft_model.get_base_model().config

    @property
    def base_model(self) -> str:
        return self.adapter.base_model


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
    storage: Path
    """The folder of checkpoints (`llmrl.server.tinker.checkpoints`) and of the base models' tokenizers."""
    seed: int = 0
    max_samplers: int = 4
    """Samplers a session keeps (each a merged copy of a model): the least recently used goes first."""
    sessions: set[str] = field(default_factory=set)
    models: dict[str, TrainedModel] = field(default_factory=dict)
    samplers: dict[str, Sampler] = field(default_factory=dict)
    futures: dict[str, asyncio.Future] = field(default_factory=dict)
    released_samplers: set[str] = field(default_factory=set)
    _bases: dict[str, tuple[torch.nn.Module, Any]] = field(default_factory=dict)
    worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmrl-tinker")
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- futures ---------------------------------------------------------------------------------

    def submit(self, work: Callable[[], Any], model_id: str | None = None) -> dict[str, Any]:
        """Queue `work` on the worker (model work runs one call at a time, in arrival order)."""
        request_id = uuid.uuid4().hex
        self.futures[request_id] = asyncio.get_running_loop().run_in_executor(self.worker, work)
        return types.UntypedAPIFuture(request_id=request_id, model_id=model_id).model_dump(exclude_none=True)

    async def retrieve(self, request_id: str) -> Response:
        future = self.futures.get(request_id)
        if future is None:
            raise Refused(
                404,
                f"request_id: no future {request_id!r} on this server (a result is kept {FUTURE_KEEP_S:.0f} s "
                "after it was first answered)",
            )
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
        finally:
            if future.done():
                asyncio.get_running_loop().call_later(FUTURE_KEEP_S, self.futures.pop, request_id, None)
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
        self.check_base(request.base_model, "base_model")
        lora = request.lora_config
        if lora is None:
            raise Refused(400, "lora_config: required (full fine-tuning is not served)")
        if not 1 <= lora.rank <= self.lora_rank_max:
            raise Refused(400, f"lora_config.rank: must be in 1..{self.lora_rank_max}, got {lora.rank}")
        self.check_optimizer(request.optimizer_config)

    def check_base(self, base_model: str, field_name: str) -> None:
        if base_model not in self.base_specs:
            raise Refused(400, f"{field_name}: {base_model!r} is not served here (served: {self.base_specs})")

    @staticmethod
    def check_optimizer(optimizer_config: Any) -> None:
        if optimizer_config is not None and not isinstance(optimizer_config, types.AdamOptimizerConfig):
            raise Refused(400, f"optimizer_config: only adamw is served, got {optimizer_config.type!r}")

    def create_model(self, request: types.CreateModelRequest) -> types.CreateModelResponse:
        lora = request.lora_config
        assert lora is not None
        adapter = AdapterRecord(
            base_model=request.base_model,
            rank=lora.rank,
            train_mlp=lora.train_mlp,
            train_attn=lora.train_attn,
            train_unembed=lora.train_unembed,
        )
        model_id = f"{request.session_id}:train:{request.model_seq_id}"
        self.new_trained_model(model_id, adapter, self.seed if lora.seed is None else lora.seed)
        return types.CreateModelResponse(model_id=model_id)

    def new_trained_model(self, model_id: str, adapter: AdapterRecord, seed: int) -> TrainedModel:
        """A training client `model_id`: a new adapter on its own copy of the base, and its AdamW."""
        peft_model, tokenizer = self.adapted_base(adapter, seed)
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        for parameter in trainable:
            parameter.data = parameter.data.float()
        optimizer = torch.optim.AdamW(trainable, lr=types.AdamParams().learning_rate)
        trained = TrainedModel(model_id, adapter, peft_model, tokenizer, optimizer)
        with self._lock:
            self.models[model_id] = trained
        return trained

    def adapted_base(self, adapter: AdapterRecord, seed: int) -> tuple[Any, Any]:
        """A PEFT LoRA adapter as `adapter` describes, over a copy of its base model, and the tokenizer."""
        import peft

        base, tokenizer = self.load_base(adapter.base_model)
        model = copy.deepcopy(base)
        targets = [
            *(ATTENTION_MODULES if adapter.train_attn else ()),
            *(MLP_MODULES if adapter.train_mlp else ()),
            *(UNEMBED_MODULES if adapter.train_unembed else ()),
        ]
        if adapter.train_unembed and model.config.tie_word_embeddings:
            # The head's adapter must not reach the input embedding when it is merged for sampling.
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
            model.config.tie_word_embeddings = False
        config = peft.LoraConfig(
            r=adapter.rank, lora_alpha=LORA_ALPHA, target_modules=targets, task_type="CAUSAL_LM"
        )
        # peft draws A from torch's global generator: the seed makes the adapter reproducible.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return peft.get_peft_model(model, config), tokenizer

    def load_base(self, spec: str) -> tuple[torch.nn.Module, Any]:
        """The base model of `spec`, loaded once (each trained model deep-copies it); its tokenizer is
        saved in the storage folder, where the SDK's ``get_tokenizer`` loads it from."""
        if spec not in self._bases:
            from llmrl.models import load_model

            model, tokenizer = load_model(spec, device=self.device)
            for parameter in model.parameters():
                parameter.requires_grad_(False)
            tokenizer.save_pretrained(self.tokenizer_folder(spec))
            self._bases[spec] = (model, tokenizer)
        return self._bases[spec]

    def tokenizer_folder(self, spec: str) -> Path:
        readable = re.sub(r"[^A-Za-z0-9._-]+", "_", spec).strip("_")
        return (
            self.storage / "tokenizers" / f"{readable}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}"
        ).resolve()

    def model(self, model_id: str) -> TrainedModel:
        trained = self.models.get(model_id)
        if trained is None:
            raise Refused(404, f"model_id: no training client {model_id!r} on this server")
        trained.last_request = datetime.now(UTC)
        return trained

    def training_runs(self) -> list[types.TrainingRun]:
        """Each training client this server holds and each run with checkpoints in its storage folder,
        the least recently used first."""
        checkpoints: dict[str, list[types.Checkpoint]] = {}
        for checkpoint in list_checkpoints(self.storage):
            checkpoints.setdefault(CheckpointPath.parse(checkpoint.tinker_path, "").run_id, []).append(
                checkpoint
            )
        runs = []
        for run_id in sorted({*self.models, *checkpoints}):
            saved = checkpoints.get(run_id, [])
            trained = self.models.get(run_id)
            if trained is not None:
                adapter, last_request = trained.adapter, trained.last_request
            else:
                newest = CheckpointPath.parse(saved[-1].tinker_path, "")
                adapter, last_request = adapter_record(newest.folder(self.storage)), saved[-1].time
            training = [c for c in saved if c.checkpoint_type == "training"]
            sampler = [c for c in saved if c.checkpoint_type == "sampler"]
            runs.append(
                types.TrainingRun(
                    training_run_id=run_id,
                    base_model=adapter.base_model,
                    model_owner="local",
                    is_lora=True,
                    lora_rank=adapter.rank,
                    last_request_time=last_request,
                    last_checkpoint=training[-1] if training else None,
                    last_sampler_checkpoint=sampler[-1] if sampler else None,
                )
            )
        return sorted(runs, key=lambda run: run.last_request_time)

    def training_run(self, run_id: str) -> types.TrainingRun:
        for run in self.training_runs():
            if run.training_run_id == run_id:
                return run
        raise Refused(404, f"training_run_id: no training run {run_id!r} on this server or in {self.storage}")

    def limits(self, model_id: str) -> tuple[int, int]:
        """The vocabulary size and positions of a training client's model."""
        config = self.model(model_id).config
        return int(config.vocab_size), max_positions(config)

    def info(self, model_id: str) -> types.GetInfoResponse:
        trained = self.model(model_id)
        return types.GetInfoResponse(
            model_id=model_id,
            model_data=types.ModelData(
                model_name=trained.base_model, tokenizer_id=str(self.tokenizer_folder(trained.base_model))
            ),
            is_lora=True,
            lora_rank=trained.adapter.rank,
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

    # -- checkpoints and samplers ------------------------------------------------------------------

    def save_state(
        self, trained: TrainedModel, request: types.SaveWeightsRequest
    ) -> types.SaveWeightsResponse:
        """``save_state``: the adapter and its optimizer's state under ``tinker://RUN/weights/NAME``."""
        path = self.checkpoint_path(trained, "weights", request.path)
        save_checkpoint(
            path,
            self.storage,
            peft_model=trained.peft_model,
            adapter=trained.adapter,
            optimizer=trained.optimizer,
            user_metadata=request.user_metadata,
            overwrite=request.overwrite,
        )
        return types.SaveWeightsResponse(path=path.tinker_path)

    def checkpoint_path(self, trained: TrainedModel, kind: str, name: str | None) -> CheckpointPath:
        if not name:
            raise Refused(400, "path: a checkpoint name is required")
        return CheckpointPath.of(trained.model_id, kind, name, field="path")

    def load_state(self, request: types.LoadWeightsRequest) -> types.LoadWeightsResponse:
        """``load_state`` into a training client, or ``create_training_client_from_state``: a new client
        made as the checkpoint's adapter was, then loaded. With ``optimizer`` the AdamW state too."""
        path = CheckpointPath.parse(request.path, "path")
        folder = checkpoint_folder(path, self.storage, "path")
        saved = adapter_record(folder)
        if request.model_id is not None:
            trained = self.model(request.model_id)
            if trained.adapter != saved:
                raise Refused(
                    400,
                    f"path: {request.path} holds an adapter made as {saved}, not as this client's {trained.adapter}",
                )
        else:
            if request.session_id is None or request.model_seq_id is None:
                raise Refused(
                    400, "model_id: required (or session_id and model_seq_id for a new training client)"
                )
            self.check_session(request.session_id)
            if request.base_model is not None and request.base_model != saved.base_model:
                raise Refused(
                    400,
                    f"base_model: {request.base_model!r} differs from the checkpoint's {saved.base_model!r}",
                )
            self.check_base(saved.base_model, "path")
            self.check_optimizer(request.optimizer_config)
            model_id = f"{request.session_id}:train:{request.model_seq_id}"
            trained = self.new_trained_model(model_id, saved, self.seed)
        load_adapter(trained.peft_model, folder)
        if request.optimizer:
            load_optimizer(trained.optimizer, folder, request.path)
        return types.LoadWeightsResponse(path=request.path, model_id=trained.model_id)

    def save_for_sampler(
        self, trained: TrainedModel, request: types.SaveWeightsForSamplerRequest
    ) -> types.SaveWeightsForSamplerResponseInternal:
        """A named sampler checkpoint (``tinker://RUN/sampler_weights/NAME``), or an unnamed snapshot
        served at once: the adapter merged into a copy of its base, with an engine of its own."""
        if request.path is not None:
            path = self.checkpoint_path(trained, "sampler_weights", request.path)
            save_checkpoint(
                path,
                self.storage,
                peft_model=trained.peft_model,
                adapter=trained.adapter,
                optimizer=None,
                user_metadata=request.user_metadata,
                overwrite=True,
            )
            return types.SaveWeightsForSamplerResponseInternal(path=path.tinker_path)
        merged = copy.deepcopy(trained.peft_model).merge_and_unload()
        session_id = trained.model_id.split(":train:")[0]
        sampler_id = f"{session_id}:sample:{request.sampling_session_seq_id}"
        self.add_sampler(sampler_id, trained.base_model, merged, trained.tokenizer)
        return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id)

    def create_sampling_session(self, request: types.CreateSamplingSessionRequest) -> str:
        """``create_sampling_client``: a sampler of a saved checkpoint (`model_path`) or of a base model."""
        sampler_id = f"{request.session_id}:sample:{request.sampling_session_seq_id}"
        if request.model_path is not None:
            folder = checkpoint_folder(
                CheckpointPath.parse(request.model_path, "model_path"), self.storage, "model_path"
            )
            saved = adapter_record(folder)
            self.check_base(saved.base_model, "model_path")
            peft_model, tokenizer = self.adapted_base(saved, self.seed)
            load_adapter(peft_model, folder)
            self.add_sampler(sampler_id, saved.base_model, peft_model.merge_and_unload(), tokenizer)
        else:
            assert request.base_model is not None
            base, tokenizer = self.load_base(request.base_model)
            self.add_sampler(sampler_id, request.base_model, copy.deepcopy(base), tokenizer)
        return sampler_id

    def add_sampler(self, sampler_id: str, base_model: str, model: torch.nn.Module, tokenizer: Any) -> None:
        """Serve `model` as `sampler_id`; past `max_samplers` in its session, the least recently used
        sampler is released."""
        engine = LocalEngine(model, tokenizer, seed=self.seed, owns_model=True)
        session_prefix = sampler_id.split(":sample:")[0] + ":"
        with self._lock:
            self.samplers[sampler_id] = Sampler(base_model, engine)
            in_session = [s for s in self.samplers if s.startswith(session_prefix)]  # least recent first
            released = in_session[: max(0, len(in_session) - self.max_samplers)]
            engines = [self.samplers.pop(old).engine for old in released]
            self.released_samplers.update(released)
        for old_engine in engines:
            old_engine.close()

    def weights_info(self, tinker_path: str) -> types.WeightsInfoResponse:
        saved = adapter_record(
            checkpoint_folder(CheckpointPath.parse(tinker_path, "tinker_path"), self.storage, "tinker_path")
        )
        return types.WeightsInfoResponse(
            base_model=saved.base_model,
            is_lora=True,
            lora_rank=saved.rank,
            train_mlp=saved.train_mlp,
            train_attn=saved.train_attn,
            train_unembed=saved.train_unembed,
        )

    def sampler(self, sampler_id: str | None) -> Sampler:
        """The sampler `sampler_id`, now the most recently used of its session."""
        with self._lock:
            sampler = self.samplers.pop(sampler_id or "", None)
            if sampler is not None:
                self.samplers[sampler_id or ""] = sampler
        if sampler is None and sampler_id in self.released_samplers:
            raise Refused(
                404,
                f"sampling_session_id: sampler {sampler_id!r} was released: a session keeps its "
                f"{self.max_samplers} most recently used samplers (--max-samplers)",
            )
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
        self.worker.shutdown(wait=True, cancel_futures=True)
        for sampler in self.samplers.values():
            sampler.engine.close()
