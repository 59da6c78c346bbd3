"""torch's CPU threads: the count each process chooses, the cores it counts, and the line a run prints."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

from llmrl import threads
from llmrl.config import load_config
from llmrl.threads import choose_threads, usable_cores, users_omp_num_threads
from llmrl.trainer.trainer import Trainer


def test_a_process_takes_its_share_of_the_cores_at_least_one():
    alone = choose_threads(cores=8, processes=1, cuda=False, omp_num_threads=None, current=8)
    assert alone.threads == 8 and alone.describe() == "torch threads 8 (of 8 cores; OMP_NUM_THREADS unset)"
    ranks = choose_threads(cores=8, processes=3, cuda=False, omp_num_threads=None, current=1)
    assert (
        ranks.threads == 2
        and ranks.describe() == "torch threads 2 (of 8 cores, 3 processes; OMP_NUM_THREADS unset)"
    )
    assert choose_threads(cores=2, processes=4, cuda=False, omp_num_threads=None, current=2).threads == 1


def test_the_users_omp_num_threads_wins_even_when_set_after_torch_loaded():
    def chosen(value: str) -> tuple[int, str]:
        choice = choose_threads(cores=8, processes=2, cuda=False, omp_num_threads=value, current=8)
        return choice.threads, choice.reason

    assert chosen("3") == (3, "OMP_NUM_THREADS=3")  # more than the share: the user's call
    assert chosen("2,1") == (2, "OMP_NUM_THREADS=2,1")  # one count per nesting level: the outer one
    assert chosen("many") == (8, "OMP_NUM_THREADS=many")  # torch ignored it too


def test_a_cuda_run_keeps_torchs_count():
    choice = choose_threads(cores=16, processes=2, cuda=True, omp_num_threads=None, current=16)
    assert choice.threads == 16 and choice.reason == "CUDA run: torch's default"


def test_torchruns_own_one_thread_is_not_the_users():
    rank = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "2"}
    assert users_omp_num_threads(rank, launcher_environ=b"PATH=/bin\0HOME=/root\0") is None
    assert users_omp_num_threads(rank, launcher_environ=b"PATH=/bin\0OMP_NUM_THREADS=1\0") == "1"
    assert users_omp_num_threads(rank, launcher_environ=None) == "1"  # no /proc: taken as set
    assert users_omp_num_threads({"OMP_NUM_THREADS": "1"}, launcher_environ=b"") == "1"  # no torchrun
    assert users_omp_num_threads({}, launcher_environ=b"") is None


def machine(root, cores_of_cpus: list[int], cgroup: dict[str, str] | None = None):
    """A sysfs under `root`: CPU i on physical core cores_of_cpus[i], and the cgroup files given."""
    for cpu, core in enumerate(cores_of_cpus):
        topology = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    for name, text in (cgroup or {}).items():
        path = root / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cores_are_the_physical_ones_of_the_affinity_capped_by_a_cpu_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    assert usable_cores(machine(tmp_path / "plain", [0, 1, 2, 3, 4, 5, 6, 7])) == 6  # 2 CPUs not ours
    assert usable_cores(machine(tmp_path / "hyperthreads", [0, 0, 1, 1, 2, 2])) == 3
    v2 = machine(tmp_path / "v2", [0, 1, 2, 3, 4, 5], {"cpu.max": "250000 100000\n"})
    assert usable_cores(v2) == 2  # 2.5 CPUs of time: 3 threads would be throttled
    assert usable_cores(machine(tmp_path / "unlimited", [0, 1, 2, 3, 4, 5], {"cpu.max": "max 100000\n"})) == 6
    v1 = {"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert usable_cores(machine(tmp_path / "v1", [0, 1, 2, 3, 4, 5], v1)) == 1  # half a CPU: still one
    v1_unlimited = {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert usable_cores(machine(tmp_path / "v1-unlimited", [0, 1, 2, 3, 4, 5], v1_unlimited)) == 6
    assert usable_cores(tmp_path / "no-sysfs") == 6  # no topology: every CPU of the affinity


def test_set_torch_threads_sets_the_choice_and_the_users_count(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "usable_cores", lambda: 3)
    try:
        assert threads.set_torch_threads(cuda=False, environ={}).threads == 3 == torch.get_num_threads()
        assert threads.set_torch_threads(cuda=False, environ={"OMP_NUM_THREADS": "1"}).threads == 1
        assert torch.get_num_threads() == 1
        assert threads.set_torch_threads(cuda=True, environ={}).threads == 1  # CUDA: left as it is
    finally:
        torch.set_num_threads(before)


def test_spinning_is_bounded_as_torch_loads_and_the_environment_is_left_as_it_was():
    probe = textwrap.dedent(
        """
        import os, sys
        from llmrl.threads import bound_openmp_spinning
        mine = {"OMP_WAIT_POLICY": "active"}
        bound_openmp_spinning(mine)
        assert mine == {"OMP_WAIT_POLICY": "active"} and "torch" not in sys.modules  # the user's policy
        bound_openmp_spinning()
        assert "torch" in sys.modules and "GOMP_SPINCOUNT" not in os.environ
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_SETTINGS}
    subprocess.run([sys.executable, "-c", probe], env=env, check=True)
    assert "torch" in sys.modules
    loaded = {}
    threads.bound_openmp_spinning(loaded)  # torch is loaded here: too late, nothing is set
    assert loaded == {}


def test_the_run_prints_its_thread_count_after_the_memory_plan(tmp_path):
    import torch

    overrides = ["training.steps=0", "evaluation.at_start=false", "evaluation.at_end=false"]
    logging = ["logging.progress=plain", "logging.tensorboard=false", "logging.trace=false"]
    stream, before = io.StringIO(), torch.get_num_threads()
    try:
        trainer = Trainer(
            load_config(None, [f"run_dir={tmp_path}", *overrides, *logging]), progress_stream=stream
        )
        trainer.run()
    finally:
        torch.set_num_threads(before)
    lines = stream.getvalue().splitlines()
    plan_end = next(i for i, line in enumerate(lines) if line.startswith("total"))
    assert lines[0].startswith("memory plan") and lines[plan_end + 1] == trainer.threads.describe()
    assert lines[plan_end + 1].startswith(
        f"torch threads {trainer.threads.threads} (of {usable_cores()} cores;"
    )
