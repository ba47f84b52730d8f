"""When a fetch's items are given up, and with which cause.

Runs on the fetcher thread (scheduler process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ec_transfer_nixl.counters import PeerCounters
from ec_transfer_nixl.stages import Stage

if TYPE_CHECKING:
    from ec_core.peer_settings import PeerAddress
    from ec_transfer_nixl.asks import Asks
    from ec_transfer_nixl.links import Links
    from ec_transfer_nixl.tasks import FetchTask, ItemFetch

CAUSE_ORDER = ("incompatible", "shape", "read_error", "not_ready", "missing")
"""Of the peers' answers for an item no peer can provide, the cause it fails with:
the first of these any peer gave (else "unreachable")."""


class Deadlines:
    """The tasks the fetcher has taken on and not finished, and their items' outcomes.

    Guarantees: an item not being read is failed once no candidate peer can still
    provide it, or at its task's lookup deadline (with the cause CAUSE_ORDER picks
    from the peers' answers; peers that never answered are marked down); every
    failed item is counted under its cause and reported once through `on_failed`;
    a task is marked done, and leaves `tasks`, once all its items are decided.
    """

    def __init__(
        self,
        *,
        counters: PeerCounters,
        on_failed: Callable[[str, str], None],
        links: Links,
        asks: Asks,
    ) -> None:
        self._counters = counters
        self._on_failed = on_failed
        self._links = links
        self._asks = asks
        self.tasks: list[FetchTask] = []
        """The tasks taken on and not done, in the order they were taken on."""

    @property
    def peers(self) -> set[PeerAddress]:
        """The peers an open task may still ask (its candidates, its handle's producer)."""
        busy: set[PeerAddress] = set()
        for task in self.tasks:
            busy.update(task.candidates)
            if task.handle is not None:
                busy.add(task.handle.peer)
        return busy

    def take_on(self, task: FetchTask) -> None:
        """Count `task` open (its items were asked of peers)."""
        self.tasks.append(task)
        self._counters.remote_lookups += len(task.items)

    def finish(self, item: ItemFetch, outcome: str) -> None:
        """Decide `item`: "landed", or failed with `outcome` (counted and reported)."""
        item.decide(outcome)
        if outcome != "landed":
            self._counters.fell_back(outcome)
            self._on_failed(item.wanted.key, outcome)

    def task_of(self, item: ItemFetch) -> FetchTask | None:
        """The open task `item` belongs to."""
        for task in self.tasks:
            if task.items.get(item.wanted.key) is item:
                return task
        return None

    def progress(self, task: FetchTask, now: float) -> bool:
        """Ask again the peers due a retry, and fail what no peer can provide; whether
        the task is done now (then it has left `tasks`)."""
        for item in task.items.values():
            stage = item.stage  # (`ItemFetch.decided` and `.reading`, inlined: the hot loop)
            if item.outcome is not None or stage is Stage.READING or stage is Stage.CONFIRMING:
                continue  # decided, or its READ decides it
            for peer, when in list(item.retry_at.items()):
                if when <= now < task.lookup_deadline:
                    self._asks.queue(peer, task, item)  # still in retry_at: not decided
            self._decide(task, item, now)
        if all(item.outcome is not None for item in task.items.values()):
            task.done = True
            self.tasks.remove(task)
            return True
        return False

    def _decide(self, task: FetchTask, item: ItemFetch, now: float) -> None:
        """Fail an item no peer can still provide; after the lookup deadline, mark the
        peers that never answered down."""
        waiting = [p for p in task.candidates if p not in item.answers or p in item.retry_at]
        if waiting and now < task.lookup_deadline:
            return
        for peer in waiting:
            tried = peer in item.asked or peer in item.retry_at  # not: a claim's other peers
            if peer in item.heard and item.answers.get(peer) is None:
                item.answers[peer] = "not_ready"  # it answered "saving" until the deadline
            elif peer not in item.answers:
                item.answers[peer] = "unreachable"
                if tried:
                    self._links.down(
                        peer, "no answer in time (no common peer secret, stopped, or overloaded)"
                    )
        causes = set(item.answers.values())
        cause = next((c for c in CAUSE_ORDER if c in causes), None)
        self.finish(item, cause or "unreachable")

    def fail_all(self, outcome: str, untaken: list[FetchTask]) -> None:
        """The fetcher stops: fail every undecided item of every open task, and of the
        `untaken` tasks (handed over, never taken on), with `outcome`; mark them done."""
        for task in [*self.tasks, *untaken]:
            for item in task.items.values():
                if not item.decided:
                    self.finish(item, outcome)
            task.done = True
        self.tasks.clear()
