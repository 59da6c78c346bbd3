"""The sandbox: escapes are tried and contained, each within its time limit, and the machine is unharmed.

Every escape runs as a code-env solution whose only test passes if the escape worked, so a
contained escape scores reward 0 and a broken sandbox would score 1.
"""

import os
import socket
import sys
import time

import pytest

from llmrl.envs import sandbox
from llmrl.envs.code import run_tests


def leftover_processes():
    """Processes still running from any sandbox run (their command line holds the work dir)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"llmrl-sandbox-" in cmdline and state != "Z":
            found.append(int(pid))
    return found


def assert_unharmed():
    deadline = time.monotonic() + 2.0
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftover_processes() == []
    assert sandbox.run("print(6 * 7)", timeout_s=5).stdout == "42\n"  # still works afterwards


def escape_reward(solution, test, *, timeout_s=1.0, memory_mb=256):
    """Reward of `solution` against the single `test` (1 means the escape succeeded), and the run."""
    run = run_tests(solution, [test], timeout_s=timeout_s, memory_mb=memory_mb)
    return sum(run.passed), run.sandbox


def test_isolation_layers_on_this_machine():
    layers = sandbox.isolation()
    assert layers["audit_hook"] and layers["resource_limits"]
    if os.geteuid() == 0:  # our machines and CI run as root, where the kernel layers apply
        assert layers["network_namespace"] and layers["pid_namespace"] and layers["unprivileged_user"]


def test_normal_run_captures_output_and_exit_status():
    result = sandbox.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)", timeout_s=5)
    assert (result.returncode, result.stdout, result.stderr, result.timed_out) == (3, "out\n", "err\n", False)
    assert not result.ok and sandbox.run("pass", timeout_s=5).ok


def test_infinite_loop_is_killed_at_the_time_limit():
    start = time.monotonic()
    reward, result = escape_reward("while True:\n    pass\nDONE = True", "assert DONE", timeout_s=0.5)
    assert reward == 0 and result.timed_out and result.returncode == -9
    assert time.monotonic() - start < 2.0
    assert_unharmed()


def test_fork_bomb_is_contained_and_killed():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    reward, result = escape_reward(bomb, "assert True", timeout_s=0.5)
    assert reward == 0 and result.timed_out
    assert time.monotonic() - start < 2.5
    assert_unharmed()


def test_process_limit_stops_forking():
    code = (
        "import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\nprint(n)"
    )
    result = sandbox.run(code, timeout_s=5, max_processes=8)
    assert result.returncode == 0 and 0 <= int(result.stdout) < 8
    assert_unharmed()


def test_children_that_leave_the_process_group_die_with_the_run():
    code = "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(60)\nprint('parent done')"
    result = sandbox.run(code, timeout_s=5)
    assert "parent done" in result.stdout
    assert_unharmed()


def test_the_fallback_without_namespaces_sweeps_escaped_children_too():
    launcher = sandbox._Launcher(prefix=(), interpreter=sys.executable, uid=-1)
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    result = sandbox._execute(launcher, code, timeout_s=5, memory_mb=512)
    assert "parent done" in result.stdout
    assert_unharmed()


def test_huge_allocation_fails_inside_the_memory_limit():
    start = time.monotonic()
    reward, result = escape_reward("block = bytearray(8 * 1024**3)", "assert len(block) > 0", memory_mb=256)
    assert reward == 0 and "MemoryError" in result.stderr
    assert time.monotonic() - start < 2.0
    assert_unharmed()


@pytest.mark.parametrize(
    "opener", ["open(TARGET, 'w').write('x')", "os.close(os.open(TARGET, os.O_WRONLY | os.O_CREAT))"]
)
def test_writing_outside_the_temp_dir_is_refused(tmp_path, opener):
    outside = [tmp_path / "escaped.txt", f"/tmp/llmrl-escape-{os.getpid()}.txt"]
    for target in outside:
        solution = f"import os\nTARGET = {str(target)!r}\n{opener}"
        reward, result = escape_reward(solution, "assert os.path.exists(TARGET)")
        assert reward == 0 and "PermissionError" in result.stderr
        assert not os.path.exists(target)
    renamed, result = escape_reward(
        f"import os\nTARGET = {str(outside[0])!r}\nopen('x', 'w').close()\nos.rename('x', TARGET)",
        "assert os.path.exists(TARGET)",
    )
    assert (
        renamed == 0 and "os.rename outside the sandbox" in result.stderr and not os.path.exists(outside[0])
    )
    assert_unharmed()


def test_writing_inside_the_temp_dir_works():
    reward, result = escape_reward(
        "open('notes.txt', 'w').write('kept')", "assert open('notes.txt').read() == 'kept'"
    )
    assert reward == 1, result.stderr


def test_opening_a_socket_is_refused():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.2)
        port = server.getsockname()[1]
        solution = f"import socket\nconnection = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nconnection.sendall(b'hi')"
        reward, result = escape_reward(solution, "assert connection")
        assert reward == 0 and "PermissionError: sandbox: socket" in result.stderr
        with pytest.raises(TimeoutError):
            server.accept()  # nobody connected
    raw, result = escape_reward("import _socket\nraw = _socket.socket()", "assert raw")
    assert raw == 0
    assert_unharmed()


def test_environment_secrets_are_not_readable(monkeypatch):
    monkeypatch.setenv("LLMRL_TEST_SECRET", "hunter2")
    from_env, result = escape_reward(
        "import os\nSECRET = os.environ.get('LLMRL_TEST_SECRET', '')\nprint(sorted(os.environ))",
        "assert 'hunter2' in SECRET",
    )
    assert from_env == 0 and "hunter2" not in result.stdout
    assert "LLMRL_TEST_SECRET" not in result.stdout
    from_proc, result = escape_reward(
        f"SECRET = open('/proc/{os.getpid()}/environ', 'rb').read().decode()", "assert 'hunter2' in SECRET"
    )
    assert from_proc == 0 and "PermissionError: sandbox: reading another process" in result.stderr
    assert_unharmed()


def test_subprocesses_and_ctypes_are_refused():
    shell, result = escape_reward(
        "import subprocess\nOUT = subprocess.run(['id'], capture_output=True)", "assert OUT"
    )
    assert shell == 0 and "subprocess.Popen" in result.stderr
    native, result = escape_reward("import ctypes\nlibc = ctypes.CDLL(None)", "assert libc")
    assert native == 0 and "PermissionError" in result.stderr


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"memory_mb": 8}, "memory_mb must be >= 64"),
        ({"max_processes": 0}, "max_processes"),
    ],
)
def test_bad_limits_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sandbox.run("pass", **kwargs)
