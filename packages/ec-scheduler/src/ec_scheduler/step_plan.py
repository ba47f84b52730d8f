"""The copies one engine step dispatches, from its first allocation to its metadata.

Runs in the scheduler process. The scheduler fills one `StepPlan` while vLLM
allocates a step's items, hands it over once (`hand_over`, in
`build_connector_meta`) and starts the next step with a fresh one: what one
step planned can never leak into the next.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ec_core.metadata import ECCPUConnectorMetadata

Shape = tuple[int, int]
Runs = tuple[tuple[int, int], ...]


class StepPlan:
    """The saves and loads of one step, and the requests each load is for.

    Guarantees:
      * `shapes` holds exactly the keys of `saves`; `takers` exactly the keys
        of `loads`; `runs` the keys of both, each key in at most one of them;
      * the metadata `hand_over` builds holds these very dicts, in the order
        the copies were planned (the per-step metadata is the plan, nothing
        more), so a plan is handed over once and not touched afterwards;
      * `withdraw_untaken` removes a load from every dict that names it;
      * `identifiers` maps exactly the keys of `saves` and `loads` that are not
        vLLM's identifier (salted keys, `ec_scheduler.tenancy`) to it.

    The scheduler reads and writes the dicts directly on its per-item paths
    (`update_state_after_alloc`): they are plain attributes for that reason.
    """

    __slots__ = ("identifiers", "loads", "runs", "saves", "shapes", "takers")

    def __init__(self) -> None:
        self.saves: dict[str, list[int]] = {}
        """The region block ids allocated for each save, in copy order."""
        self.shapes: dict[str, Shape] = {}
        """The `(rows, cols)` each save was allocated for."""
        self.loads: dict[str, tuple[int, list[int], Shape]] = {}
        """`(transfer_id, block_ids, (rows, cols))` per load."""
        self.runs: dict[str, Runs] = {}
        """The runs of consecutive blocks of each save and load."""
        self.takers: dict[str, list[str]] = {}
        """The requests each load is for (the same item in several requests of one
        step is loaded once)."""
        self.identifiers: dict[str, str] = {}
        """vLLM's identifier of each key of `saves` and `loads` that is not one."""

    def add_save(
        self,
        key: str,
        block_ids: list[int],
        shape: Shape,
        runs: Runs,
        *,
        identifier: str | None = None,
    ) -> None:
        """Plan a save of `key` (the item vLLM names `identifier`; None: `key`) into
        `block_ids`, for an output of `shape`."""
        self.saves[key] = block_ids
        self.shapes[key] = shape
        self.runs[key] = runs
        if identifier is not None and key != identifier:
            self.identifiers[key] = identifier

    def add_load(
        self,
        key: str,
        transfer_id: int,
        block_ids: list[int],
        shape: Shape,
        runs: Runs,
        *,
        identifier: str | None = None,
    ) -> None:
        """Plan a load of `key` (the item vLLM names `identifier`; None: `key`; its
        takers are added by the caller)."""
        self.loads[key] = (transfer_id, block_ids, shape)
        self.runs[key] = runs
        if identifier is not None and key != identifier:
            self.identifiers[key] = identifier

    def withdraw_untaken(
        self, freed: Iterable[str], scheduled: Mapping[str, object]
    ) -> list[tuple[str, Shape]]:
        """Remove the loads of `freed` items that no request in `scheduled` takes;
        their keys and shapes, in `freed`'s order (the caller releases their pins
        and takes back their counts).

        `freed` is the step's `free_encoder_mm_hashes`. Priority scheduling can
        preempt a request after its items were allocated (its load planned), and a
        later allocation of the step can then evict the item from vLLM's encoder
        cache. The workers drop the step's freed items before they load: landed,
        the load would sit in their encoder cache untracked (device memory vLLM
        never frees, unless a later request brings the same item back). A load
        that a scheduled request takes is kept even if its item is named (vLLM's
        encoder cache manager names only items it no longer holds at the step's
        end; the encoder-decoder one names the items of the step before, which a
        request of this step may load again).
        """
        withdrawn: list[tuple[str, Shape]] = []
        for key in self._load_keys_of(freed):
            takers = self.takers.get(key)
            if takers is None or key not in self.loads:
                continue
            if any(request_id in scheduled for request_id in takers):
                continue
            _, _, shape = self.loads.pop(key)
            del self.takers[key]
            self.runs.pop(key, None)
            self.identifiers.pop(key, None)
            withdrawn.append((key, shape))
        return withdrawn

    def _load_keys_of(self, identifiers: Iterable[str]) -> Iterable[str]:
        """The keys of the loads of vLLM's `identifiers`, in their order (`freed`
        names vLLM's identifiers; a salted load's key wraps one)."""
        if not self.identifiers:
            return identifiers
        by_identifier: dict[str, list[str]] = {}
        for key in self.loads:
            by_identifier.setdefault(self.identifiers.get(key, key), []).append(key)
        return [key for identifier in identifiers for key in by_identifier.get(identifier, ())]

    def hand_over(self, step: int) -> ECCPUConnectorMetadata:
        """The workers' metadata for step number `step`: this plan's copies."""
        return ECCPUConnectorMetadata(
            saves=self.saves,
            loads=self.loads,
            step=step,
            save_shapes=self.shapes,
            runs=self.runs,
            identifiers=self.identifiers,
        )
