"""The eviction policies' names, as users give them in `ec_eviction_policy`.

Every process validates that setting (`ec_core.settings`), and only the
scheduler process builds a policy, so the names live apart from the policies:
importing this module imports no policy. Each policy class takes its `name`
from here, and the registry (`ec_core.scheduler_process.policy.POLICIES`) is
keyed by those; a test checks that `POLICY_NAMES` is exactly its keys.
"""

from __future__ import annotations

LRU = "lru"
S3LFU = "s3lfu"
WTINYLFU = "wtinylfu"

POLICY_NAMES: tuple[str, ...] = tuple(sorted((LRU, S3LFU, WTINYLFU)))
"""Every policy's name, sorted (the order the settings' error message lists them in)."""

DEFAULT_POLICY = WTINYLFU
"""The policy used when `ec_eviction_policy` is not set."""
