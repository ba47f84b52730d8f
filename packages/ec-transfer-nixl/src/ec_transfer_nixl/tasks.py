"""What a fetch is: a request's task, its items, and the handle lease it may carry.

Built by the scheduler thread (`NixlRemoteSource.wants`), which then reads only
`FetchTask.done`; everything else is read and written by the fetcher thread
alone, both in the scheduler process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ec_transfer_nixl.stages import NEXT, IllegalMoveError, Stage

if TYPE_CHECKING:
    from ec_core.peer_settings import PeerAddress
    from ec_scheduler.remote import Wanted


@dataclass(frozen=True, eq=False)
class HandleLease:
    """A request-level handle's pre-granted lease, its signature checked already.

    Guarantees: every key in `spans` has its shape in `shapes`; the spans are where
    the producer said (signed) the entry's bytes lie in its region while the lease
    pins it.
    """

    peer: PeerAddress
    lease: int
    agent: str
    """The producer's NIXL agent the spans belong to."""
    spans: dict[str, list[tuple[int, int]]]
    """Per leased key, where its bytes lie in the producer's region."""
    shapes: dict[str, tuple[int, int]]


@dataclass(eq=False)
class ItemFetch:
    """One item of a task: its stage, which peers were asked, and what came of it.

    Guarantees: `stage` changes only through `move`, along `stages.NEXT`; `outcome`
    is set exactly when the stage becomes terminal ("landed" or the cause it failed
    with), and never changes after.
    """

    wanted: Wanted
    answers: dict[PeerAddress, str] = field(default_factory=dict)
    """Per peer, what it said of the item (a fallback cause); absent: awaited."""
    retry_at: dict[PeerAddress, float] = field(default_factory=dict)
    """Per peer, when to ask it again (still saving, or not connected yet)."""
    heard: set[PeerAddress] = field(default_factory=set)
    """Peers that answered for this item at least once (they are up)."""
    asked: set[PeerAddress] = field(default_factory=set)
    """Peers a lookup (or claim) for this item went to."""
    outcome: str | None = None
    """"landed" or a failure cause; None while undecided."""
    stage: Stage = Stage.STAGED

    def move(self, to: Stage) -> None:
        """Move the item to stage `to`; IllegalMoveError if `stages.NEXT` does not allow it."""
        if to not in NEXT[self.stage]:
            raise IllegalMoveError(f"an item cannot move from {self.stage.name} to {to.name}")
        self.stage = to

    def decide(self, outcome: str) -> None:
        """Give the item its outcome: LANDED for "landed", else FAILED with that cause."""
        self.move(Stage.LANDED if outcome == "landed" else Stage.FAILED)
        self.outcome = outcome

    @property
    def decided(self) -> bool:
        """Whether the item has its outcome (its stage is terminal)."""
        return self.outcome is not None

    @property
    def reading(self) -> bool:
        """Whether a READ into its blocks runs or awaits its claim's answer."""
        stage = self.stage
        return stage is Stage.READING or stage is Stage.CONFIRMING


@dataclass(eq=False)
class FetchTask:
    """The fetches one request waits for.

    Guarantees: `done` is the only field the scheduler thread reads, and it never
    turns back to False; for a task handed to the fetcher, it turns True only once
    every item is decided (landed or failed).
    """

    request_id: str
    items: dict[str, ItemFetch]
    candidates: tuple[PeerAddress, ...]
    lookup_deadline: float
    deadline: float
    done: bool = False
    handle: HandleLease | None = None
    features: int = 0
    """How many multimodal items the request had when it was asked (a streaming-input
    session's later chunks add more)."""
