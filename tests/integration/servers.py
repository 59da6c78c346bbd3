"""Start llmrl servers as real processes for integration tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import httpx

from llmrl.processes import free_port


@contextlib.contextmanager
def serving(module: str, *args: str, log_path, headers=None, startup_s: float = 120.0):
    """Run ``python -m module args`` until /healthz answers; yields its base URL; always stops it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + startup_s
            while True:
                assert process.poll() is None, f"{module} exited: {log_path.read_text()}"
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/healthz", headers=headers, timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, f"{module} did not start: {log_path.read_text()}"
                time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
