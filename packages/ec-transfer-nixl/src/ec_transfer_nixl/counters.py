"""What the cross-engine layer counts (cumulative; names as in ec_core.stats).

Each field but `fallbacks` is written by one thread only (the producer's server
or the consumer's fetcher) and read by the scheduler thread when it publishes
stats. `fallbacks` is written by the fetcher and by the scheduler thread (a
handle naming an incompatible engine), so it is updated and read under a lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ec_core.stats import labelled_key

FALLBACK_CAUSES = (
    "unreachable",  # no answer within the lookup timeout (down, wrong secret, too slow)
    "missing",  # no peer holds it
    "not_ready",  # a peer was still saving it when time ran out
    "shape",  # a peer holds it with another shape
    "incompatible",  # the peer's fingerprint differs (model, dtype, width, block, wire)
    "no_space",  # no room in this engine's region for it
    "read_error",  # the READ failed, or ended after the lease
    "timeout",  # the fetch did not finish within ec_peer_fetch_timeout_s
)


@dataclass
class PeerCounters:
    # consumer side
    remote_lookups: int = 0
    """Items asked of peers."""
    remote_hits: int = 0
    """Items fetched from a peer into this engine's region."""
    bytes_fetched: int = 0
    fetch_seconds: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)
    """Items not fetched, by cause (they are encoded here)."""
    # producer side
    lookups_served: int = 0
    """Items leased to peers."""
    lookups_not_ready: int = 0
    """Items peers asked for while this engine was still saving them."""
    bytes_served: int = 0
    """Bytes of leased items whose READ the peer finished."""
    requests_denied: int = 0
    """Messages dropped: not signed with the shared secret, stale, or malformed."""
    _fallbacks_lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def fell_back(self, cause: str) -> None:
        """Count one item not fetched; safe from any thread (no increment is lost)."""
        with self._fallbacks_lock:
            self.fallbacks[cause] = self.fallbacks.get(cause, 0) + 1

    def totals(self) -> dict[str, float]:
        """The figures under their stats names; safe while other threads count."""
        with self._fallbacks_lock:
            fallbacks = dict(self.fallbacks)
        data: dict[str, float] = {
            "remote_lookups": self.remote_lookups,
            "remote_hits": self.remote_hits,
            "bytes_fetched": self.bytes_fetched,
            "fetch_seconds": self.fetch_seconds,
            "peer_lookups_served": self.lookups_served,
            "peer_lookups_not_ready": self.lookups_not_ready,
            "peer_bytes_served": self.bytes_served,
            "peer_requests_denied": self.requests_denied,
        }
        for cause, count in fallbacks.items():
            data[labelled_key("remote_fallbacks", cause)] = count
        return data
