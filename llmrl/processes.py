"""The local processes llmrl starts (servers, rendezvous) and the ports they listen on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now (for a server to bind, or a rendezvous)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
