"""The interface every eviction policy implements, and the policies by name.

The allocator owns the entries and their states; a policy only orders the
entries the allocator tells it are evictable (ready and unpinned), says which
missed items deserve a save, and names victims. The allocator never evicts a
key a policy names unless it is evictable, so no policy can break the pin and
readiness rules.

Every method of every policy is O(log n) in the number of entries (amortised
where noted). The implementations: `policy_lru`, `policy_s3lfu`,
`policy_wtinylfu` (the default); their names, which every process needs
without them, are in `ec_core.policy_names`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from ec_core.scheduler_process.policy_lru import LRUPolicy
from ec_core.scheduler_process.policy_s3lfu import S3LFUPolicy
from ec_core.scheduler_process.policy_wtinylfu import WTinyLFUPolicy


@runtime_checkable
class EvictionPolicy(Protocol):
    """The events an allocator reports, and the questions it asks."""

    name: str

    @property
    def strict_order(self) -> bool:
        """Whether the allocator must evict in exactly this policy's order now.

        True: the order carries the policy's information (recency), so a new
        entry never costs an entry the order ranks later than the victims it
        names, even if that splits the new entry over several runs. False: the
        allocator may evict a window of address-adjacent entries, weighed by
        their rank in the order, to keep the new entry in one run.
        """

    def on_request(self, key: str, held: bool) -> None:
        """Someone asked for `key`: on a consumer once per item vLLM schedules (a key
        once per step), on an engine that only produces once per save, and once per
        read a peer makes. `held`: the pool holds a ready entry of `key` (its save
        has finished), which makes the request a hit; a policy counts its hits
        here, not when an entry is pinned (`on_held`)."""

    def admit(self, key: str, num_blocks: int) -> bool:
        """Whether a missed item of `num_blocks` should be saved at all."""

    def on_insert(self, key: str, num_blocks: int) -> None:
        """A new, not yet ready entry was allocated for `key`."""

    def on_evictable(self, key: str, num_blocks: int) -> None:
        """`key` became evictable: its save finished, or its last pin went."""

    def on_held(self, key: str) -> None:
        """`key` was pinned (a lookup's promise, a load, a peer's read); it is not
        evictable until released. Not a request, nor a hit: vLLM looks an item up,
        and the scheduler pins it, again at every step its request waits."""

    def on_removed(self, key: str) -> None:
        """`key` left the pool (evicted, discarded or dropped)."""

    def candidates(self) -> Iterator[str]:
        """Evictable keys, the policy's preferred victims first (lazy).

        The allocator weighs address-adjacent victims by their position in
        this order when it evicts a window to keep a new entry in one run.
        """

    def stats(self) -> dict[str, float]:
        """The policy's own figures, by their stats names (`ec_core.stats`):
        `policy_lru_mode` (1.0 while it evicts as plain LRU, else 0.0) and, for
        a policy that changes mode, the cumulative `policy_mode_changes`."""


POLICIES: dict[str, type[LRUPolicy] | type[S3LFUPolicy] | type[WTinyLFUPolicy]] = {
    policy.name: policy for policy in (WTinyLFUPolicy, S3LFUPolicy, LRUPolicy)
}
"""Policies by the name users give in the config (`ec_eviction_policy`); each
is built as `POLICIES[name](num_blocks)`."""


def make_policy(name: str, num_blocks: int) -> EvictionPolicy:
    """A fresh policy object for a configured policy name and the pool's size in
    blocks (required: the size-aware policies scale their budgets and shadows
    to it, and a missing size would silently make a one-block pool of them)."""
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}")
    if num_blocks < 0:
        raise ValueError(f"a pool cannot have {num_blocks} blocks")
    return policy(num_blocks)
