"""The ZMQ sockets peers talk over, set up alike on both ends.

Used by the producer's server thread (a ROUTER it binds) and the consumer's
fetcher thread (a DEALER per peer it connects to), in the scheduler process.
"""

from __future__ import annotations

from typing import Any

import zmq

from ec_core.peer_settings import PeerAddress

MAX_FRAME_BYTES = 64 << 20
"""The largest message a peer socket takes. ZMQ assembles a whole message in memory
before anyone can check its signature, so without a bound any host that reaches the
port could make the engine's process hold gigabytes; a sender past it is
disconnected unread. The largest real messages (a lookup or a reply for thousands of
items, each entry in many runs) are a few MiB."""


def peer_socket(context: zmq.Context[Any], kind: int, address: PeerAddress) -> zmq.Socket[Any]:
    """A socket of `kind` for talking to peers at (or listening on) `address`, not yet
    bound or connected: it discards what is still queued when closed (LINGER 0, so
    closing never blocks), refuses messages over MAX_FRAME_BYTES, and speaks IPv6
    when the address is IPv6."""
    sock: zmq.Socket[Any] = context.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if address.is_ipv6:
            sock.setsockopt(zmq.IPV6, 1)
    except BaseException:
        sock.close(0)
        raise
    return sock
