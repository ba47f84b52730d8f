"""Whether an item may be read in the shape, and from the spans, a peer offers.

Runs on the fetcher thread (scheduler process), for lookups' answers and
handles alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_core.ratelimit import RateLimitedWarnings
from ec_scheduler.remote import ANY_WIDTH

if TYPE_CHECKING:
    from ec_core.peer_settings import PeerAddress
    from ec_scheduler.remote import Wanted
    from ec_transfer_nixl.tasks import ItemFetch


class Shapes:
    """Accepts or refuses what peers offer for an item.

    Guarantees: an item is accepted only in a shape `Wanted.accepts` for this
    engine's embedding width, and its width is then fixed from the offer; every
    refusal is said in a rate-limited warning.
    """

    def __init__(self, *, embed_width: int, itemsize: int, warnings: RateLimitedWarnings) -> None:
        """`embed_width`: this engine's LM embedding width, which every encoder output
        width a peer offers for an item asked with any width must be a multiple of."""
        self._embed_width = embed_width
        self._itemsize = itemsize
        self._warnings = warnings

    def nbytes(self, wanted: Wanted) -> int:
        """The bytes of the item `wanted`."""
        return wanted.rows * wanted.cols * self._itemsize

    def takes(self, peer: PeerAddress, item: ItemFetch, offered: tuple[int, int] | None) -> bool:
        """Whether `item` may be read as the shape `peer` holds it in (`offered`; None from
        a producer that does not say), fixing the item's width from it. The peer is
        compatible (same fingerprint), so an offered width that `Wanted.accepts` is the
        one this engine's model produces."""
        if offered is None:
            if item.wanted.cols != ANY_WIDTH:
                return True  # the producer answered OK for exactly the width asked
        elif item.wanted.accepts(offered, self._embed_width):
            item.wanted = item.wanted.with_cols(offered[1])
            return True
        self.refused(peer, item.wanted, offered or (0, 0))
        return False

    def refused(self, peer: PeerAddress, wanted: Wanted, offered: tuple[int, int]) -> None:
        """Say why an item a peer holds is not fetched from it for its shape."""
        asked = "any width" if wanted.cols == ANY_WIDTH else f"width {wanted.cols}"
        self._warnings.warn(
            "shape",
            "EC CPU tier: peer %s holds item %s as %d x %d, but this engine needs %d rows "
            "(its placeholder's embeddings) of %s (a multiple of the embedding width %d); "
            "encoding it here. A reused multimodal UUID, or engines configured differently "
            "for one model, do this",
            peer,
            wanted.key,
            offered[0],
            offered[1],
            wanted.rows,
            asked,
            self._embed_width,
        )

    def fits(self, peer: PeerAddress, item: ItemFetch, spans: list[tuple[int, int]]) -> bool:
        """Whether a peer's `spans` hold exactly the item's bytes; if not (a broken
        peer: a READ of them would write past the item's blocks here), say so."""
        if holds(spans, self.nbytes(item.wanted)):
            return True
        self._warnings.warn(
            "spans",
            "EC CPU tier: peer %s offered item %s in spans of %d bytes, not the "
            "%d its shape takes; encoding it here",
            peer,
            item.wanted.key,
            sum(n for _, n in spans),
            self.nbytes(item.wanted),
        )
        return False


def holds(spans: list[tuple[int, int]], nbytes: int) -> bool:
    """`spans` (a peer's) are `nbytes` in all, each of a positive length at a valid
    address: a negative length would shift the READ's local side out of its blocks."""
    return all(a >= 0 and n > 0 for a, n in spans) and sum(n for _, n in spans) == nbytes
