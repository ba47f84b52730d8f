"""Free TCP ports on the loopback for test servers, light to import (no vLLM, no torch).

Runs in the test, demo or benchmark process that starts the servers.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` (an IPv4 or IPv6 loopback literal) that nothing is bound
    to now, taken below the kernel's ephemeral range where there is room. A port from
    that range (what binding port 0 gives) can be handed to any process's next port-0
    or outgoing socket before the test's server binds it: a CI run lost a peer test to
    "Address already in use" so, its port taken by the other engine's own sockets."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    rng = random.SystemRandom()
    low = _ephemeral_low()
    for _ in range(64 if low > 11_024 else 0):
        port = rng.randrange(low - 10_000, low)
        with socket.socket(family) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue  # in use (or lingering): try another
            return port
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux); 0 where unknown."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
