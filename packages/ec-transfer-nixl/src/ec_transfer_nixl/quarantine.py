"""READs given up that NIXL still holds, and the blocks they keep reserved.

Runs on the fetcher thread (scheduler process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ec_scheduler.remote import LocalEntries
    from ec_transfer_nixl.agent import RegionAgent
    from ec_transfer_nixl.reads import ReadGroup
    from ec_transfer_nixl.releases import Releases


class Quarantine:
    """READs past their deadline (or failed) whose items have failed, until NIXL lets
    go of them.

    INVARIANT (enforced here): a reservation whose READ may still write is never
    freed. A READ that NIXL will not release stays here, its blocks reserved (not
    ready, never loaded), until NIXL reports it finished; only then are its blocks
    freed and its pins given back.
    """

    def __init__(
        self, *, local: LocalEntries, agent: Callable[[], RegionAgent], releases: Releases
    ) -> None:
        self._local = local
        self._agent = agent
        self._releases = releases
        self.groups: list[ReadGroup] = []

    def __len__(self) -> int:
        return len(self.groups)

    def end(self, group: ReadGroup) -> None:
        """A READ whose items failed: free its blocks now if NIXL lets go of it, else
        hold it here until it does."""
        if self._agent().release(group.handle):
            self.free(group)
        else:
            self.groups.append(group)

    def drain(self) -> None:
        """Free the blocks of every held READ that NIXL has let go of since."""
        agent = self._agent()
        still = []
        for group in self.groups:
            if agent.state(group.handle) == "PROC" or not agent.release(group.handle):
                still.append(group)
            else:
                self.free(group)
        self.groups = still

    def free(self, group: ReadGroup) -> None:
        """A READ that will write no more and whose items failed: free their blocks,
        and give its pins back."""
        self._local.abandon_many([item.wanted.key for item in group.items])
        self._releases.after_read(group.peer, group.granted, read=False)
