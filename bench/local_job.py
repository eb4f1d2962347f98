"""What the benchmarks that start local gloo jobs share."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on the loopback that no one holds now, for a job's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
