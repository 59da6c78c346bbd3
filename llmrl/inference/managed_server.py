"""A model server that llmrl starts and owns (`ServeConfig`): llmrl's own (`llmrl serve-inference`) or
vLLM's OpenAI-compatible server, serving a model that the run asks (a distillation teacher) rather than
the policy, so with none of the flags that training the served model needs. Like the managed vLLM
servers of `inference.type: vllm`, it never outlives the process that started it
(`llmrl.processes.ServerProcess`)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from llmrl.config import ModelConfig, ServeConfig
from llmrl.errors import UserError
from llmrl.inference.vllm.server import CPU_PREFILL_FLAG, find_vllm_python, served_model_path
from llmrl.processes import ServerProcess, ServerStartError, free_port

HOST = "127.0.0.1"


class ModelServerStartError(ServerStartError, UserError):
    """A managed model server exited while starting or never answered: most often its model cannot be
    loaded, which the log's last lines in the message show."""


class ManagedModelServer(ServerProcess):
    """One server of `config.model` on a free port of 127.0.0.1; `base_url` is its OpenAI API root."""

    start_error = ModelServerStartError

    def __init__(
        self,
        config: ServeConfig,
        *,
        log_path: Path,
        seed: int,
        field: str = "serve",
        max_logprobs: int | None = None,
    ):
        """`field`: where `config` sits in the run's config, for the errors; `max_logprobs`: the most
        logprobs a request may ask per position (vLLM's --max-logprobs; None: vLLM's default; llmrl's
        server has no such limit)."""
        super().__init__(
            name=f"the {config.engine} server of {field}.model={config.model}",
            host=HOST,
            port=free_port(HOST),
            log_path=log_path,
            health_route="/healthz" if config.engine == "llmrl" else "/health",
            startup_timeout_s=config.startup_timeout_s,
            timeout_field=f"{field}.startup_timeout_s",
        )
        self.config = config
        self.seed = seed
        self.max_logprobs = max_logprobs
        self.python = find_vllm_python(None) if config.engine == "vllm" else sys.executable

    @property
    def base_url(self) -> str:
        """The OpenAI API root (ending in /v1), what `ServedTeacher` and OpenAI clients take."""
        return f"{self.root_url}/v1"

    def command(self) -> list[str]:
        """The server's command line, then `extra_args`."""
        config = self.config
        common = ["--dtype", config.dtype, "--seed", str(self.seed), "--host", HOST, "--port", str(self.port)]
        if config.engine == "llmrl":
            command = [self.python, "-m", "llmrl", "serve-inference", "--model", config.model, *common]
        else:
            model = served_model_path(
                ModelConfig(spec=config.model, dtype=config.dtype), self.log_path.parent / "model"
            )
            command = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *common]
            if self.max_logprobs is not None:
                command += ["--max-logprobs", str(self.max_logprobs)]
            if not torch.cuda.is_available():
                command.append(CPU_PREFILL_FLAG)
        return command + list(config.extra_args)

    def environment(self) -> dict[str, str]:
        return super().environment() | self.config.env


def start_model_server(
    config: ServeConfig,
    *,
    log_path: Path,
    seed: int,
    field: str = "serve",
    max_logprobs: int | None = None,
) -> ManagedModelServer:
    """A server of `config.model`, started and answering (`ModelServerStartError` otherwise, naming the
    model, the port and `log_path`, with the log's last lines); `close()` stops it, and it stops by itself
    when this process exits or dies. `seed` seeds requests that carry none; `field` and `max_logprobs` as
    `ManagedModelServer`'s."""
    server = ManagedModelServer(config, log_path=log_path, seed=seed, field=field, max_logprobs=max_logprobs)
    try:
        server.start()
    except BaseException:
        server.close()
        raise
    return server
