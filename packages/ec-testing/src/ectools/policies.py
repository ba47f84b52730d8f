"""Eviction policies that only tests use, shared by the allocator's test modules."""

from __future__ import annotations

from ec_core.scheduler_process.policy_lru import LRUPolicy


class WindowLRU(LRUPolicy):
    """LRU order, but windows of neighbours allowed (a policy whose order is not strict)."""

    strict_order = False
