"""The stages one item of a fetch goes through, and the moves allowed between them.

Pure data, used on the fetcher thread (scheduler process); `ItemFetch.move` is
the one place an item changes stage, and it raises IllegalMoveError on a move
`NEXT` does not allow. The moves, and what makes each:

    STAGED      -> CLAIMING     a handle's lease covers it
                -> LOOKING_UP   otherwise
    CLAIMING    -> READING      the producer's agent is known: READ at once
                -> LOOKING_UP   claimed without a READ, or not claimable after all
    LOOKING_UP  -> READING      a peer leased it, and blocks were reserved
    READING     -> CONFIRMING   the handle READ is over before its claim's answer
                -> LANDED       the READ completed, and its lease held
                -> LOOKING_UP   its claim was refused: asked again
    CONFIRMING  -> LANDED       the claim confirmed the lease and the spans
                -> LOOKING_UP   its claim was refused: asked again
    any open    -> FAILED       with a cause (no peer has it, no room, timeout, ...)
"""

from __future__ import annotations

import enum


class Stage(enum.Enum):
    """Where one item of a fetch is; the stage says which part of the fetcher holds it."""

    # Members are singletons compared by identity: hash them so too, in C (Enum's own
    # __hash__ is Python code, and every move and stage test on the fetch path hashes).
    __hash__ = object.__hash__

    STAGED = "staged"
    """Submitted by the scheduler thread; the fetcher thread has not taken it on."""
    CLAIMING = "claiming"
    """Its handle's lease is claimed (with a READ, if the producer's agent is known)
    at the start of the next pass."""
    LOOKING_UP = "looking_up"
    """Asked of peers with a lookup (or a claim without a READ), or about to be, or
    waiting to ask again; undecided."""
    READING = "reading"
    """A READ into blocks reserved for it runs (on a lookup's lease or a handle's)."""
    CONFIRMING = "confirming"
    """Its handle READ is over; the claim's answer, which says whether the bytes are
    the entry's, has not come yet."""
    LANDED = "landed"
    """The entry is ready in this engine's region (terminal)."""
    FAILED = "failed"
    """Not fetched, with a cause: the request encodes it (terminal)."""


NEXT: dict[Stage, frozenset[Stage]] = {
    Stage.STAGED: frozenset({Stage.CLAIMING, Stage.LOOKING_UP, Stage.FAILED}),
    Stage.CLAIMING: frozenset({Stage.LOOKING_UP, Stage.READING, Stage.FAILED}),
    Stage.LOOKING_UP: frozenset({Stage.READING, Stage.FAILED}),
    Stage.READING: frozenset({Stage.CONFIRMING, Stage.LOOKING_UP, Stage.LANDED, Stage.FAILED}),
    Stage.CONFIRMING: frozenset({Stage.LOOKING_UP, Stage.LANDED, Stage.FAILED}),
    Stage.LANDED: frozenset(),
    Stage.FAILED: frozenset(),
}
"""Per stage, the stages an item may move to from it. An item moves only forward
but for one loop: a READ whose claim was refused (or whose spans moved) sends its
item back to LOOKING_UP, once the READ can no longer write its blocks."""

TERMINAL = frozenset(stage for stage, after in NEXT.items() if not after)
"""LANDED and FAILED: an item there has its outcome, and never moves again."""


class IllegalMoveError(RuntimeError):
    """An item was moved between stages the table does not connect: a bug here."""
