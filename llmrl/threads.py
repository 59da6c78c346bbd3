"""torch's CPU threads: how many a process computes with, and how long they spin between ops.

torch's defaults suit a machine of its own: one OpenMP thread per core, and threads that keep spinning
after each parallel op, waiting for the next (GNU libgomp, which torch's Linux wheels ship: 300,000
iterations, milliseconds). Beside another busy process, one of the team's threads shares its core with
it, and every op waits until the scheduler runs that thread: on 2 cores beside one busy loop the demo
(~100 small ops per decode step) trained 6-10x slower than alone. Two changes, measured on the demo
(docs/benchmarks.md, "CPU threads"):

- Spinning is bounded (`SPIN_COUNT` iterations, then the thread sleeps), before torch loads
  (`bound_openmp_spinning`): libgomp reads its environment once, as it loads. Beside a busy process
  the demo then trains in about twice its time alone, and alone takes 3-10% longer than with torch's
  spin (no setting measured does both: a longer spin is faster alone and slower beside the other).
- The thread count is the share of the cores this process may use (`choose_threads`): those of its
  CPU affinity, capped by a container's CPU quota, divided among the processes torchrun started on the
  machine; torch counts neither the quota nor the other ranks (torchrun gives each rank 1).

What a user set stays: `OMP_NUM_THREADS` (the count; from Python, in `os.environ` before the run)
and `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` (the spinning). A `torch.set_num_threads` call before the run
is replaced: torch cannot tell its count from its default. CUDA runs keep torch's count: their CPU ops
are few. The count changes a run's numbers at the rounding level, so it depends only on the machine,
never on its load: the same config gives the same numbers on the same machine. Inter-op threads
(`torch.set_num_interop_threads`) serve `torch.jit.fork` alone, which llmrl does not use; they stay.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

SPIN_COUNT = 4000
"""Iterations libgomp's threads spin after an op before they sleep (`GOMP_SPINCOUNT`; its default is
300,000). Fewer lose idle speed (1,000: the demo ~20% slower alone), more lose it beside a busy process
(10,000: ~2.5x its idle time); docs/benchmarks.md."""

WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""The environment variables with which a user chooses the spinning themselves."""


def bound_openmp_spinning(environ: MutableMapping[str, str] = os.environ) -> None:
    """Load torch with its OpenMP threads spinning `SPIN_COUNT` iterations at most, unless the user set
    the wait policy or torch is already loaded (then nothing changes). The environment is left as it
    was, so that the processes this one starts (vLLM's servers, sandboxes) keep their own defaults."""
    if "torch" in sys.modules or any(name in environ for name in WAIT_SETTINGS):
        return
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    try:
        import torch  # noqa: F401  libgomp reads GOMP_SPINCOUNT as torch loads it
    finally:
        del environ["GOMP_SPINCOUNT"]


@dataclasses.dataclass(frozen=True)
class ThreadChoice:
    """torch's intra-op thread count for this process, and who chose it."""

    threads: int
    cores: int
    """Cores this process may use (`usable_cores`)."""
    processes: int
    """Processes torchrun started on this machine (`LOCAL_WORLD_SIZE`), which share the cores."""
    reason: str
    """Who chose: the user (`OMP_NUM_THREADS=N`), torch (a CUDA run) or llmrl (`OMP_NUM_THREADS unset`)."""

    def describe(self) -> str:
        """One line for the start of a run, e.g. ``torch threads 2 (of 2 cores; OMP_NUM_THREADS unset)``."""
        shared = f", {self.processes} processes" if self.processes > 1 else ""
        return f"torch threads {self.threads} (of {self.cores} cores{shared}; {self.reason})"


def choose_threads(
    *, cores: int, processes: int, cuda: bool, omp_num_threads: str | None, current: int
) -> ThreadChoice:
    """The thread count of one process.

    Args:
        cores: cores this process may use (`usable_cores`).
        processes: processes sharing them (torchrun's ranks on this machine).
        cuda: the process computes on a GPU: torch's count stays.
        omp_num_threads: `OMP_NUM_THREADS` as the user set it (None: unset, or torchrun's own 1).
        current: torch's count now.
    """
    if omp_num_threads is not None:
        # Set after torch loaded (os.environ in a notebook), it is applied here; a list ("4,2", one
        # count per nesting level) sets the outer level.
        head = omp_num_threads.split(",")[0].strip()
        threads = int(head) if head.isdigit() and int(head) > 0 else current
        return ThreadChoice(threads, cores, processes, f"OMP_NUM_THREADS={omp_num_threads}")
    if cuda:
        return ThreadChoice(current, cores, processes, "CUDA run: torch's default")
    return ThreadChoice(max(1, cores // processes), cores, processes, "OMP_NUM_THREADS unset")


def usable_cores(root: Path = Path("/")) -> int:
    """Physical cores among the CPUs this process may run on (its affinity), as torch counts them by
    default (hyperthreads of one core share its arithmetic units), capped by the CPU quota of the
    container it runs in (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`), rounded down: threads beyond a
    quota are throttled, and wait for each other at every op."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cores = _physical_cores(cpus, root) if cpus else None
    cores = cores or (len(cpus) if cpus else os.cpu_count() or 1)
    quota = _cpu_quota(root)
    return max(1, min(cores, math.floor(quota))) if quota is not None else cores


def _physical_cores(cpus: list[int], root: Path) -> int | None:
    """Distinct (package, core) pairs of `cpus` (Linux sysfs); None where the topology is not readable."""
    try:
        return len(
            {
                tuple(
                    (root / f"sys/devices/system/cpu/cpu{cpu}/topology/{name}").read_text().strip()
                    for name in ("physical_package_id", "core_id")
                )
                for cpu in cpus
            }
        )
    except OSError:
        return None


def _cpu_quota(root: Path) -> float | None:
    """CPUs the container's CPU quota allows; None without one (or off Linux)."""
    cgroup = root / "sys/fs/cgroup"
    try:
        limit, period = (cgroup / "cpu.max").read_text().split()
        return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        pass
    try:
        limit = int((cgroup / "cpu/cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu/cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return limit / period if limit > 0 and period > 0 else None


def users_omp_num_threads(environ: Mapping[str, str], launcher_environ: bytes | None) -> str | None:
    """`OMP_NUM_THREADS` when the user set it; None when unset, or set to 1 by torchrun, which does so
    for the ranks it starts unless the user set it: then its own environment as it was started
    (`launcher_environ`, its /proc/PID/environ) has none."""
    value = environ.get("OMP_NUM_THREADS")
    if value != "1" or "TORCHELASTIC_RUN_ID" not in environ or launcher_environ is None:
        return value
    return value if b"\0OMP_NUM_THREADS=" in b"\0" + launcher_environ else None


def set_torch_threads(cuda: bool | None = None, environ: Mapping[str, str] = os.environ) -> ThreadChoice:
    """Choose this process's thread count (`choose_threads`), set it in torch and return it. Called on
    the thread that computes, before it starts others: a thread takes the count set last when it first
    computes, and keeps it.

    Args:
        cuda: whether the process computes on a GPU (None: whenever torch sees one).
    """
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    current = torch.get_num_threads()
    choice = choose_threads(
        cores=usable_cores(),
        processes=int(environ.get("LOCAL_WORLD_SIZE", "1")),
        cuda=cuda,
        omp_num_threads=users_omp_num_threads(environ, _launcher_environ()),
        current=current,
    )
    if choice.threads != current:
        torch.set_num_threads(choice.threads)
    return choice


def _launcher_environ() -> bytes | None:
    """The environment the parent process (torchrun, for a rank) was started with; None off Linux."""
    try:
        return Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return None
