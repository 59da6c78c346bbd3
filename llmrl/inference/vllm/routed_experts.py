"""Whether router replay can take its routes from a vLLM, and the one line that refuses it.

vLLM 0.32 returns the experts each token was routed through when started with
``enable_return_routed_experts`` (`CompletionOutput.routed_experts`, ``[prompt + completion - 1
tokens, layers, k]``, uint8 or uint16; over HTTP only from the token-in-token-out route
``/inference/v1/generate``, as base64 ``.npy``, not from the OpenAI routes llmrl calls). It captures
them in Model Runner V2 alone, and that runner needs a Triton that runs on the platform: a CUDA build
has one; the CPU build needs Triton's CPU backend (triton-cpu), which the Triton on PyPI lacks, so
there vLLM refuses the flag when the engine starts. Where vLLM would return them llmrl does not read
them yet, so router replay refuses every vLLM, saying which of these holds for the one in use.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import NoReturn

from llmrl.config import ConfigError

_PROBE = """
import dataclasses, json, vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON
print(json.dumps({
    "version": vllm.__version__,
    "device": current_platform.device_type,
    "has_flag": "enable_return_routed_experts" in {f.name for f in dataclasses.fields(EngineArgs)},
    "has_triton": bool(HAS_TRITON),
}))
"""
"""Run in the vLLM's own interpreter: a managed server's is another Python than the trainer's."""

PROBE_TIMEOUT_S = 120


@dataclass(frozen=True)
class RoutedExpertsSupport:
    """What decides whether a vLLM returns routed experts, as that vLLM reports it."""

    version: str
    device: str
    """vLLM's platform: ``cuda``, ``cpu``, ..."""
    has_flag: bool
    """Its engine takes ``enable_return_routed_experts``."""
    has_triton: bool
    """vLLM's own verdict (``vllm.triton_utils.HAS_TRITON``) on whether Model Runner V2 can run."""


def vllm_routed_experts_support(python: str) -> RoutedExpertsSupport:
    """What the vLLM of interpreter `python` supports."""
    try:
        probe = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except OSError as exc:
        failure = exc.strerror
    except subprocess.TimeoutExpired:
        failure = f"no answer in {PROBE_TIMEOUT_S} s"
    else:
        failure = None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["no output"])[-1]
    if failure is not None:
        raise ConfigError(
            f"training.router_replay: could not ask {python}'s vLLM whether it returns routed experts: {failure}"
        )
    return RoutedExpertsSupport(**json.loads(probe.stdout.strip().splitlines()[-1]))


def router_replay_refusal(support: RoutedExpertsSupport | None) -> str:
    """Why router replay cannot run on `support`'s vLLM (None: servers someone else runs, whose vLLM
    llmrl cannot inspect)."""
    advice = "; use the embedded engine (inference.type: local)"
    if support is None:
        return (
            "training.router_replay: llmrl does not read the experts vLLM servers route each token through yet "
            "(vLLM returns them from /inference/v1/generate when started with --enable-return-routed-experts "
            "on Model Runner V2)" + advice
        )
    vllm = f"vLLM {support.version}"
    if not support.has_flag:
        return (
            f"training.router_replay: {vllm} has no enable_return_routed_experts, so it cannot return routes"
            + advice
        )
    if not support.has_triton:
        backend = "CPU backend" if support.device == "cpu" else f"{support.device} backend"
        triton = "Triton with a CPU backend (triton-cpu)" if support.device == "cpu" else "Triton"
        return (
            f"training.router_replay: {vllm}'s {backend} does not return routed experts "
            f"(enable_return_routed_experts needs Model Runner V2, which needs {triton}, and vLLM found none)"
            + advice
        )
    return (
        f"training.router_replay: {vllm} on {support.device} returns routed experts "
        "(enable_return_routed_experts), but llmrl does not read them from vLLM yet" + advice
    )


def refuse_router_replay(python: str | None) -> NoReturn:
    """Raise `ConfigError` saying why router replay cannot run on the vLLM of interpreter `python`
    (None: servers someone else runs)."""
    support = vllm_routed_experts_support(python) if python is not None else None
    raise ConfigError(router_replay_refusal(support))


__all__ = [
    "RoutedExpertsSupport",
    "refuse_router_replay",
    "router_replay_refusal",
    "vllm_routed_experts_support",
]
