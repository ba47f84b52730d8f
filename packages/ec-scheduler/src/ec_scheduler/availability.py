"""Whether an item is, or will be, available to a request from the region.

Runs in the scheduler process, under the scheduler's lock. `Availability`
owns the three things that decide it: promises (ready entries pinned for a
lookup until a load takes them or the step ends), stale entries (entries
that hold another item under the same identifier, or outputs of weights vLLM
replaced), and items without input (metadata only, `ec_scheduler.inputs`),
whose requests fail unless something can supply them.

Every entry is named by its item's tier key (`ec_scheduler.tenancy`): the
identifier, or for a request with a `cache_salt` the identifier wrapped with
the salt's digest, so a request sees only its own salt's entries.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any

from ec_core._vllm import get_logger
from ec_core.scheduler_process.allocator import BlockAllocator, Entry
from ec_scheduler.counters import SchedulerCounters
from ec_scheduler.inputs import ItemInputs
from ec_scheduler.remote import ANY_WIDTH, RemoteSource, Wanted

if TYPE_CHECKING:
    from vllm.multimodal.inputs import PlaceholderRange
    from vllm.v1.request import Request

logger = get_logger(__name__)


def _holds_nothing(request: Request, index: int, num_computed_tokens: int) -> bool:
    return False


def num_embeds(position: PlaceholderRange) -> int:
    """`position.get_num_embeds()`, without building its cached cumulative sum when
    every placeholder token is an embedding (`is_embed` None): the engine core's
    request objects arrive without it, and this runs before vLLM computes it."""
    return position.length if position.is_embed is None else position.get_num_embeds()


class Availability:
    """Promises, stale entries and requests no one can supply.

    Guarantees:
      * a promised entry is ready, holds one pin for its promise, and is not
        stale; the pin passes to a load (`take_promise`) or is released at
        the step's end (`release_promises`);
      * a stale key is never promised, and it is dropped from the allocator
        as soon as nothing holds it (its last pin, or its copy's report);
      * a ready entry whose row count differs from a request's item is stale
        from then on, and counted once (`stale_dropped`);
      * a request with an item still to be encoded that carries no input, and
        that neither vLLM's encoder cache, nor a ready entry of its row count,
        nor a fetch can supply, waits until `take_unavailable` hands it over
        (once);
      * with a remote source, every item a request lacks is offered to it, and
        `deferred` records that one asked the request to wait.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        counters: SchedulerCounters,
        inputs: ItemInputs,
        widths: dict[str, int],
        warn_now_and_then: Callable[..., Any],
    ) -> None:
        """`widths` is the scheduler's own dict of measured widths (shared, not copied)."""
        self.allocator = allocator
        self.counters = counters
        self.inputs = inputs
        self.widths = widths
        self._warn_now_and_then = warn_now_and_then
        self.promised: set[str] = set()
        """Keys looked up this step and pinned for their load."""
        self.stale: set[str] = set()
        """Keys whose entry is still held but must never be loaded or served."""
        self.unavailable: set[str] = set()
        """Requests with an item no one can supply, until `take_unavailable`."""
        self.deferred = False
        """A request waits for a remote source's fetches (the scheduler resets it)."""
        self.vllm_holds: Callable[[Request, int, int], bool] = _holds_nothing
        """Whether vLLM's own encoder cache holds item `index` of a request when it
        gets to it (`shell.own_cache.keeps`; the shell sets it)."""

    # ------------------------------------------------------------ promises

    def promise(self, key: str, loading: Container[str]) -> bool:
        """`has_cache_item` on a consumer, for the item's tier key `key`: True iff it is
        promised, loaded this step (`loading`), or ready now, in which case it is
        promised on the spot.

        A stale entry holds another item under this key: even a load of it
        dispatched this step (for a request vLLM then preempted, dropping the item
        from its own cache and so from its row-count check) would serve the other
        item's rows, so it answers False first.
        """
        if key in self.stale:
            return False
        if key in self.promised or key in loading:
            return True
        allocator = self.allocator
        entry = allocator.get(key)
        if entry is None or not entry.ready:
            return False
        # Pinned now, so an allocation later in this step cannot evict it before
        # update_state_after_alloc dispatches the load.
        allocator.pin_entry(entry)
        self.promised.add(key)
        return True

    def take_promise(self, key: str) -> None:
        """The promise of `key` became a load: its pin now belongs to the load."""
        self.promised.discard(key)

    def release_promises(self) -> None:
        """Release the promises no load took (vLLM looked them up but did not schedule them)."""
        for key in self.promised:
            self.release_pin(key)
        self.promised.clear()

    def release_pin(self, key: str) -> None:
        """Release one pin of `key`; a stale entry goes with its last pin."""
        entry = self.allocator.unpin(key)
        if entry.pins == 0 and key in self.stale:
            self.stale.discard(key)
            self.allocator.drop(key)

    # ------------------------------------------------------------- requests

    def ensure(
        self,
        request: Request,
        num_computed_tokens: int,
        remote: RemoteSource | None,
        suffix: str,
    ) -> bool:
        """`ensure_cache_available` on a consumer: False while the request waits.

        `suffix` turns the request's identifiers into its entries' keys
        (`TierKeys.suffix` of the request, computed once by the caller).

        Stale entries of the request's items are retired here, so the item is a
        miss instead of a silently wrong load. With a remote source, the items
        not ready here are offered to it; without one, this defers only a
        request it has found unavailable.
        """
        if request.request_id in self.unavailable:
            return False
        if remote is not None:
            if not self._ask_remote(request, num_computed_tokens, remote, suffix):
                return False
            return self._all_supplied(request, num_computed_tokens, suffix)
        # Without a remote source: retire the request's stale entries, and learn
        # whether every item carries its input (else `_all_supplied` must look
        # further). This runs for every request vLLM looks at in every step, so
        # it is one loop, with the usual answers tested inline: an item of a
        # modality without metadata-only fields that has data carries its input
        # (`ItemInputs.carries_input`; here the fields are read under vLLM's
        # UserDict, whose own `len` is a Python call: any other container takes
        # the call), and a ready entry with the item's row count is not stale
        # (`_holds`).
        entries = self.allocator.get
        plain = self.inputs.plain
        all_carry = True
        for feature in request.mm_features:
            if all_carry and not (
                feature.modality in plain and getattr(feature.data, "data", None)
            ):
                all_carry = self.inputs.carries_input(feature)
            entry = entries(feature.identifier + suffix if suffix else feature.identifier)
            if entry is None:
                continue
            position = feature.mm_position
            if num_computed_tokens and position.offset + position.length <= num_computed_tokens:
                continue  # already consumed by the model; will not be looked up
            shape = entry.shape
            if (
                entry.ready
                and shape is not None
                and position.is_embed is None  # (`num_embeds` is then its length)
                and shape[0] == position.length
            ):
                continue
            self._holds(entry, num_embeds(position), request.request_id)
        return all_carry or self._all_supplied(request, num_computed_tokens, suffix)

    def take_unavailable(self) -> set[str]:
        """The requests found unavailable since the last call (each once)."""
        if not self.unavailable:
            return set()
        taken, self.unavailable = self.unavailable, set()
        return taken

    def _all_supplied(self, request: Request, num_computed_tokens: int, suffix: str) -> bool:
        """False, with the request marked unavailable, if one of its items still to be
        encoded carries no input and nothing holds it.

        An item with input (nearly every item) costs one test here: the rest only
        runs for items without input."""
        carries_input = self.inputs.carries_input
        for index, feature in enumerate(request.mm_features):
            if carries_input(feature):
                continue
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # already consumed by the model; will not be looked up
            key = feature.identifier + suffix if suffix else feature.identifier
            entry = self.allocator.get(key)
            if (
                entry is not None
                and entry.ready
                and entry.shape is not None
                and entry.shape[0] == num_embeds(position)
                and key not in self.stale
            ):
                if key not in self.promised:
                    # Promised now, as `promise` would: between this check and
                    # vLLM's lookup the fetcher thread may reserve blocks, evicting it,
                    # and an item without input must not reach the encoder.
                    self.allocator.pin_entry(entry)
                    self.promised.add(key)
                continue
            if self.vllm_holds(request, index, num_computed_tokens):
                continue
            self.unavailable.add(request.request_id)
            self._warn_now_and_then(
                "unavailable",
                "EC CPU tier: request %s has a %s item %s given without its input "
                "(metadata only), and no engine holds its encoder output; the "
                "request is failed (send its input, or retry once a producer has it)",
                request.request_id,
                feature.modality,
                key,
            )
            return False
        return True

    def _ask_remote(
        self, request: Request, num_computed_tokens: int, remote: RemoteSource, suffix: str
    ) -> bool:
        """With a remote source: retire stale entries and offer it what is missing."""
        entries = self.allocator.get
        missing: list[Wanted] = []
        for feature in request.mm_features:
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # already consumed by the model; will not be looked up
            key = feature.identifier + suffix if suffix else feature.identifier
            entry = entries(key)
            rows = num_embeds(position)
            if entry is not None and self._holds(entry, rows, request.request_id):
                continue
            if rows > 0:  # absent, or not ready yet: its save or fetch is under way
                # In the width a save of it has (a producer's entries have their
                # modality's measured width, wider than the embedding for DeepStack
                # encoders). vLLM measures widths on producers only, so a pure
                # consumer asks for any width and takes the peer's (`Wanted`).
                cols = self.widths.get(feature.modality, ANY_WIDTH)
                missing.append(Wanted(key, rows, cols))
        # Asked even with nothing missing: items being fetched for this request are
        # reserved here (not ready), and the request waits until they land.
        if remote.wants(request, missing):
            self.deferred = True
            return False
        return True

    # -------------------------------------------------------- stale entries

    def _holds(self, entry: Entry, rows: int, request_id: str) -> bool:
        """True if `entry` is ready and holds exactly `rows` rows. A ready entry
        with another row count is stale: it is retired here (once: an entry
        already retired and still pinned is not counted again) and False returned."""
        if not entry.ready or entry.shape is None:
            return False
        if entry.shape[0] == rows:
            return True
        if entry.key not in self.stale:
            self._retire_stale(entry, rows, request_id)
        return False

    def _retire_stale(self, entry: Entry, rows: int, request_id: str) -> None:
        self._warn_now_and_then(
            "stale",
            "EC CPU tier: entry %s holds %d rows but request %s needs %d for that "
            "item (reused multimodal UUID?); dropping it and encoding again",
            entry.key,
            entry.shape[0] if entry.shape else -1,
            request_id,
            rows,
        )
        self.counters.stale_dropped += 1
        if entry.key in self.promised:
            # Promised to a request looked up earlier in this step that vLLM then
            # passed over (it allocates a request's items before it looks at the
            # next request): kept, the promise would answer this request's lookup
            # and load the other rows for it.
            self.promised.discard(entry.key)
            self.allocator.unpin(entry.key)
        if entry.evictable:
            self.allocator.drop(entry.key)
        else:
            # Pinned by a load in flight: never promise it again, drop it when
            # the last pin goes.
            self.stale.add(entry.key)

    def invalidate(self) -> None:
        """Forget every entry (vLLM reset its encoder cache: the model's weights
        changed). Ready, unpinned entries are dropped at once; an entry still in
        use (pinned, or not ready: a save or a fetch in flight) becomes stale."""
        self.release_promises()
        allocator = self.allocator
        entries = list(allocator)
        held = 0
        for entry in entries:
            if entry.evictable:
                allocator.drop(entry.key)
            else:
                self.stale.add(entry.key)
                held += 1
        logger.info(
            "EC CPU tier: vLLM reset its encoder cache (model weights changed): %d entries "
            "dropped, %d more once their copies end",
            len(entries) - held,
            held,
        )

    def drop_free_stale(self) -> None:
        """Drop the stale entries nothing holds any more (a save or fetch marked stale
        by `invalidate` that has since landed), and forget stale keys that are gone."""
        allocator = self.allocator
        free = [key for key in self.stale if (e := allocator.get(key)) is None or e.evictable]
        for key in free:
            self.stale.discard(key)
            if key in allocator:
                allocator.drop(key)

    def clear(self) -> None:
        """Forget every promise, stale key and unavailable request (shutdown)."""
        self.promised.clear()
        self.stale.clear()
        self.unavailable.clear()
