"""The items to ask each peer for at the end of the fetcher's pass.

Runs on the fetcher thread (scheduler process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ec_core.peer_settings import PeerAddress
    from ec_transfer_nixl.tasks import FetchTask, ItemFetch

Asked = dict[str, tuple["FetchTask", "ItemFetch"]]
"""Key -> the task and item that want it."""


class Asks:
    """Per peer, the items to ask it for in this pass's lookups.

    Guarantees: an item is queued at most once per peer (by key); `take` hands
    the whole queue over and leaves it empty, so each queued ask goes out once.
    """

    def __init__(self) -> None:
        self._queued: dict[PeerAddress, Asked] = {}

    @property
    def peers(self) -> list[PeerAddress]:
        """The peers something is queued for."""
        return list(self._queued)

    def queue(self, peer: PeerAddress, task: FetchTask, item: ItemFetch) -> None:
        """Ask `peer` for `item` (of `task`) at the end of this pass."""
        self._queued.setdefault(peer, {})[item.wanted.key] = (task, item)

    def again(self, task: FetchTask, item: ItemFetch) -> None:
        """Ask every candidate peer of `task` for `item` anew (their answers forgotten)."""
        for peer in task.candidates:
            item.answers.pop(peer, None)
            self.queue(peer, task, item)

    def take(self) -> dict[PeerAddress, Asked]:
        """Everything queued, per peer; the queue is left empty."""
        queued, self._queued = self._queued, {}
        return queued
