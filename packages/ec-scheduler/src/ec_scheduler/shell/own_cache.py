"""vLLM's own encoder cache, as the connector sees it.

An item without input (`ec_scheduler.inputs`) can still be served when vLLM's
encoder cache holds it (another request encoded or loaded it), and only then
is it no reason to fail its request (`ECCPUScheduler.ensure_cache_available`).
vLLM gives a connector no view of that cache, so the first scheduler-side
connector built in a process wraps `Scheduler.add_request`
(`shell.vllm_patches.ADD_REQUEST`): once vLLM has taken a request, a connector
of this project is given the scheduler's encoder cache manager, before any
step asks it about that request.

Holding an item is not enough: scheduling a request, vLLM makes room for
its items that are not in its cache by evicting its unreferenced items, oldest
first, before it looks at the request's later items; one of those, given
without input, would then be encoded (`keeps`).

Guarantees: a manager that is not `readable` is not read (items without
input then count as held by no one in vLLM).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request


def readable(manager: Any) -> bool:
    """Whether `manager` is an encoder cache manager `keeps` can read (vLLM's
    encoder-decoder one has no cache: its items are always encoded)."""
    return (
        isinstance(getattr(manager, "cached", None), dict)
        and isinstance(getattr(manager, "freeable", None), dict)
        and isinstance(getattr(manager, "num_free_slots", None), int)
    )


def keeps(manager: Any, request: Request, index: int, num_computed_tokens: int) -> bool:
    """Whether vLLM's encoder cache (`manager`, `readable`) holds item `index` of
    `request` and still holds it when vLLM looks at that item in this step.

    An item some request references is never evicted. An unreferenced one is,
    oldest first, when the request's earlier items still to be computed that
    the cache lacks need the room: it is kept only if the free slots and the
    unreferenced items older than it (not the request's own: vLLM takes those
    up as it goes) make enough room for them all."""
    cached = manager.cached
    features = request.mm_features
    key = features[index].identifier
    if key not in cached:
        return False
    if cached[key]:
        return True
    own: set[str] = set()
    needed = 0
    for feature in features[:index]:
        identifier = feature.identifier
        position = feature.mm_position
        if identifier == key:
            return True  # looked up there first, and referenced from then on
        if identifier in own or position.offset + position.length <= num_computed_tokens:
            continue
        own.add(identifier)
        if identifier not in cached:
            needed += position.get_num_embeds()
    room = manager.num_free_slots
    for victim, embeds in manager.freeable.items():  # oldest first
        if room >= needed:
            return True
        if victim == key:
            return False
        if victim not in own:
            room += embeds
    return True
