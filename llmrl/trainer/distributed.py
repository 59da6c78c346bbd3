"""Training over several processes: ``torchrun --nproc-per-node N -m llmrl train CONFIG``.

The policy is sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`, each decoder layer and then
the root) over a one-dimensional device mesh: gloo on CPU, NCCL on GPUs (one per process, by
``LOCAL_RANK``). Rank 0 alone owns the agents, the inference side, the rollout pipeline and bank,
evaluation and every run-folder output (colocated vLLM runs an engine in every process, all serving
rank 0: `llmrl.inference.vllm.ranks`); each step it broadcasts the step's rollout groups. Every
rank then computes the same `RolloutBatch` and loss denominators from the whole batch and trains on
its token-balanced share of each mini-batch (`split_by_tokens`). The losses are already divided by
the global denominator, so gradients are summed across ranks (gradient divide factor 1), and a run
computes the same update as one process, up to the order of floating-point additions.

No rank but 0 ever holds the full model: rank 0 loads it, the others build it on the meta device,
and rank 0's weights reach every rank's shards tensor by tensor (`Distributed.load_model`). The
weight sync gathers the shards for rank 0's inference side (or each process's colocated engine) in
bounded buckets (`Distributed.gathered_buckets`), so a process holds one bucket at a time besides its
engine.

With LoRA (`model.lora`) the adapters are built over the model before it is sharded (`load_model`'s
`prepare`), so each block's unit holds its frozen base weights and its adapters; only the adapters
train, are gathered for a sync and are checkpointed (`llmrl.trainer.lora`).

FSDP2 runs collectives inside every forward and backward pass, so every rank must run the same
number of them: a rank with fewer micro-batches than the others runs zero-weight passes
(`ForwardPasses` asks `max_count` how many).

Teardown, in this order and before the interpreter exits: the rollout worker thread is joined
(the pipeline closes first), then `close` waits for every rank at a barrier and destroys the process
group. After an error a rank leaves without the barrier, which its peers may never reach (torchrun
then ends them); a peer whose barrier fails because the failed rank has gone still destroys the
group. The group must be destroyed before the interpreter exits. Observed with gloo (torch 2.13,
Python 3.11): a process that ends right after a collective without destroying its group aborts at
exit ("terminate called without an active exception") in about a quarter of runs. The backtrace: a
gloo worker thread (``ProcessGroupGloo::runLoop``) drops the finished collective's work, whose
tensors have Python objects; releasing them takes the GIL, a thread that asks for it while the
interpreter finalizes is ended with ``pthread_exit``, and that unwinds through a C++ destructor,
which calls ``std::terminate``. The same abort comes, every time, from a daemon thread still inside
a torch op at exit, with or without a process group (why the inference engine's thread is not a
daemon: Python joins the other threads before it finalizes).
"""

from __future__ import annotations

import os
import types
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from llmrl.models import load_model
from llmrl.models.shape import registered_names
from llmrl.weights import weight_buckets


def split_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Deal positions 0..len(lengths)-1 into `parts` lists of about equal total length.

    Longest first, each to the part with the fewest tokens so far (the lowest part on a tie); every
    part keeps its positions in ascending order. Deterministic, so every rank computes the same split.
    """
    shares: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for position in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        part = min(range(parts), key=lambda p: (totals[p], p))
        shares[part].append(position)
        totals[part] += lengths[position]
    return [sorted(share) for share in shares]


def _run_backbone(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return model.base_model(*args, **kwargs)


class ShardedCausalLM:
    """A sharded causal LM as `llmrl.algorithms.logprobs.token_logprobs` uses it.

    Its `base_model` runs the backbone inside the root module's FSDP hooks, which gather the root's
    own parameters (embeddings, final norm, the LM head) and keep them gathered after the forward,
    so the LM head that `token_logprobs` applies next is whole; their gradients are reduced at the
    end of the backward pass.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.config = getattr(model, "config", None)
        self.base_model = model.sharded_backbone

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The module that registers the parameter or buffer `name`, and its attribute name there."""
    module_name, _, attribute = name.rpartition(".")
    return model.get_submodule(module_name), attribute


class Distributed:
    """This process's place in a multi-process run, and the collectives the trainer needs."""

    def __init__(self, rank: int, world_size: int, device: str):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.mesh = init_device_mesh(device, (world_size,))

    @classmethod
    def from_env(cls, device: str) -> Distributed | None:
        """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ...); None for one process.

        `device` is "cpu" (gloo) or "cuda" (NCCL, the GPU of ``LOCAL_RANK``).
        """
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return None
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
        try:
            return cls(dist.get_rank(), dist.get_world_size(), device)
        except BaseException:
            dist.destroy_process_group()  # never exit with the group alive (module docstring)
            raise

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, model: torch.nn.Module, *, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
        """Shard `model` in place with FSDP2: each block its class names as unsplittable, then the root.

        Gradients are summed across ranks, not averaged: the loss is normalised globally already.
        With `compute_dtype`, each block's gathered parameters are cast to it for the forward and
        backward passes, while the shards (the master weights) keep their dtype and gradients are
        reduced in float32.
        """
        policy = (
            MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
            if compute_dtype
            else None
        )
        options = {"mesh": self.mesh} | ({"mp_policy": policy} if policy else {})
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, **options)
        fully_shard(model, **options)
        # `token_logprobs` runs the backbone and applies the LM head itself, never the root's forward;
        # the backbone is run through a method that FSDP treats as the root's forward instead.
        model.sharded_backbone = types.MethodType(_run_backbone, model)
        register_fsdp_forward_method(model, "sharded_backbone")
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                # gloo has no pre-multiplied sum; a plain sum (divided by 1) is what we want anyway.
                module.set_force_sum_reduction_for_comms(True)
        return model

    def load_model(
        self,
        spec: str,
        *,
        device: str,
        compute_dtype: torch.dtype | None = None,
        prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        **options: Any,
    ) -> tuple[torch.nn.Module, Any]:
        """`llmrl.models.load_model(spec, device=device, **options)`, sharded (`shard`, with
        `compute_dtype`), with no full copy on any device and none in host memory but rank 0's.

        `prepare` (LoRA's adapters) makes the model to shard out of the loaded one, first on rank 0's
        loaded weights (its random draws are the one-process run's), then on the meta-built model of
        every rank, which draws none: rank 0's prepared weights reach every rank's shards.

        Every rank builds the model on the meta device (no memory) and shards it; rank 0 also loads
        the weights into host memory and broadcasts them one tensor at a time, each rank keeping its
        shard on `device`; rank 0's host copy is freed on return. (Loaded onto its GPU, a 32B model
        in float32 would need 131 GB there before it is sharded.) What a state dict lacks is
        mended: aliases (tied embeddings), which loading into a meta model replaces by separate
        tensors, are tied again, and the non-persistent buffers (rotary ``inv_freq``) are the loaded
        model's.
        """
        del device  # the shards land on this process's device (`self.device`)
        loaded, tokenizer = load_model(spec, device="cpu", **options) if self.is_main else (None, None)
        model, meta_tokenizer = load_model(spec, device="meta", **options)
        if prepare is not None:
            loaded = prepare(loaded) if loaded is not None else None
            with torch.random.fork_rng(devices=[]):
                model = prepare(model)
        first_names = registered_names(model)
        full = loaded.state_dict() if loaded is not None else {}
        buffers = dict(loaded.named_buffers()) if loaded is not None else {}
        del loaded  # `full` and `buffers` hold what is still needed of it
        self.shard(model, compute_dtype=compute_dtype)
        with (
            warnings.catch_warnings()
        ):  # DCP's look-up of the default device of a meta-built model warns twice
            warnings.simplefilter("ignore", UserWarning)
            set_model_state_dict(
                model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            )
        del full
        for name, first in first_names.items():
            if name != first:
                setattr(*_owner(model, name), getattr(*_owner(model, first)))
        for module_name, module in model.named_modules():
            for name in sorted(
                module._non_persistent_buffers_set
            ):  # sorted: set order differs between processes
                buffer = module._buffers[name]
                if buffer is None:
                    continue
                full_name = f"{module_name}.{name}" if module_name else name
                value = (
                    buffers[full_name].to(self.device)
                    if self.is_main
                    else torch.empty_like(buffer, device=self.device)
                )
                dist.broadcast(value, src=0)
                module._buffers[name] = value
        return model, tokenizer if self.is_main else meta_tokenizer

    def gathered_buckets(
        self,
        model: torch.nn.Module,
        bucket_bytes: int,
        *,
        held_on: str | None,
        skip: Collection[str] = (),
        dtype: torch.dtype | None = None,
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The unsharded weights, but the names in `skip`, in buckets of at most `bucket_bytes`
        (`weight_buckets`: a decoder layer larger than that is one bucket), on the device `held_on`
        ("cpu", or this process's device for a receiver in this process), or empty buckets where it is
        None (a process that only takes part); floating-point weights in `dtype` when given (what
        inference serves: half the bytes of float32 master weights to move and hold).

        Each bucket is all-gathered by every rank when it is read, so every rank must read the
        iterator to its end, in step; a process holds the bucket it is given and no other.
        """
        state = {name: value for name, value in get_model_state_dict(model).items() if name not in skip}
        sizes = {name: value.numel() * value.element_size() for name, value in state.items()}
        for names in weight_buckets(list(state), sizes, bucket_bytes):
            bucket = {}
            for name in names:
                value = state[name].full_tensor() if isinstance(state[name], DTensor) else state[name]
                if held_on is not None:
                    cast = dtype if dtype and value.is_floating_point() else value.dtype
                    bucket[name] = value.to(held_on, cast)
            yield bucket

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (picklable objects; pydantic models included)."""
        holder = [obj if self.is_main else None]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def max_count(self, count: int) -> int:
        """The largest `count` over the ranks."""
        value = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def barrier(self) -> None:
        dist.barrier()

    def close(self, *, wait: bool = True) -> None:
        """Leave the process group (see the module docstring); with `wait`, once every rank is done.

        The group is destroyed even when the barrier fails (a peer that failed has left without it).
        """
        if not dist.is_initialized():
            return
        try:
            if wait:
                dist.barrier()
        finally:
            dist.destroy_process_group()


class OneProcess:
    """The processes of a run of one: `Distributed`'s collectives, each of which is then the identity, so
    that the loop runs the same code whatever the number of processes."""

    is_main = True
    world_size = 1

    def broadcast_object(self, obj: Any = None) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def max_count(self, count: int) -> int:
        return count

    def barrier(self) -> None:
        pass

    def close(self, *, wait: bool = True) -> None:
        pass
