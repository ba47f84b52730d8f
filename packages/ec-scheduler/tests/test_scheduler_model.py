"""A hypothesis state machine over random request streams, ranks and reports."""

from __future__ import annotations

import functools
import tempfile
from dataclasses import replace

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from vllm.config import VllmConfig

from ec_core.layout import region_layout
from ec_core.metadata import ECCPUConnectorMetadata
from ec_core.settings import ECCPUSettings
from ec_scheduler import ECCPUScheduler
from ectools.configs import make_vllm_config
from ectools.driving import Item, SimulatedRanks, StepDriver, connector_output, make_request
from ectools.tiny_blip2 import write_config_only

BLOCK = 512
KEYS = [f"img{i}" for i in range(8)]
TIMEOUT_STEPS = 4


@functools.cache
def _config() -> VllmConfig:
    folder = tempfile.mkdtemp(prefix="ec-sched-model-")
    return make_vllm_config(
        write_config_only(folder), extra={"ec_cpu_bytes": "1MiB"}, widths={"image": 128}
    )


items = st.lists(
    st.builds(Item, st.sampled_from(KEYS), st.sampled_from([4, 8, 8, 8, 16])),
    min_size=1,
    max_size=3,
)


class SchedulerMachine(RuleBasedStateMachine):
    """Random steps; reports delivered late, out of order, duplicated or never.

    Checked after every step:
      * every dispatched load names a ready entry whose blocks and shape match;
      * blocks of a load that some rank has not acknowledged are never handed
        to a save (they would be overwritten while a rank still reads them);
      * nothing is held forever: after all reports are in or the bound has
        passed, no entry is held and nothing is in flight.
    """

    RANKS = 1

    def __init__(self) -> None:
        super().__init__()
        config = _config()
        layout = region_layout(config)
        settings_ = ECCPUSettings.from_extra_config(
            {
                "ec_cpu_bytes": 40 * BLOCK,
                "ec_report_timeout_steps": TIMEOUT_STEPS,
                "ec_report_timeout_s": 0,
            },
            block_size_bytes=BLOCK,
        )
        self.scheduler = ECCPUScheduler(
            config, layout=replace(layout, num_blocks=40, settings=settings_)
        )
        self.driver = StepDriver(self.scheduler)
        self.sim = SimulatedRanks(self.RANKS)
        self.undelivered: list[tuple[ECCPUConnectorMetadata, int]] = []  # (meta, rank)
        # The model's own view of loads still being read: tid -> (blocks, step
        # dispatched, ranks that acknowledged). Independent of the scheduler's
        # bookkeeping, so a scheduler that releases too early is caught.
        self.live_loads: dict[int, tuple[set[int], int, set[int]]] = {}
        self.steps = 0

    def _reusable_blocks_excluded(self) -> set[int]:
        """Blocks no save may get in the step being scheduled now."""
        held: set[int] = set()
        for tid, (blocks, dispatched, acked) in list(self.live_loads.items()):
            all_acked = len(acked) == self.RANKS
            # The scheduler may reclaim a lost load at the end of the build of
            # worker step dispatched + TIMEOUT + 1; saves from the next step on
            # may then use its blocks.
            reclaimable = self.steps - dispatched > TIMEOUT_STEPS + 1
            if all_acked or reclaimable:
                del self.live_loads[tid]
            else:
                held |= blocks
        return held

    @rule(batch=st.lists(items, min_size=1, max_size=3))
    def schedule(self, batch: list[list[Item]]) -> None:
        self.steps += 1
        held_by_loads = self._reusable_blocks_excluded()
        requests = [make_request(f"s{self.steps}r{i}", it) for i, it in enumerate(batch)]
        meta = self.driver.step(requests).meta
        if held_by_loads and meta.saves:
            event("a save was allocated while loads were in flight")
        for key, blocks in meta.saves.items():
            assert held_by_loads.isdisjoint(blocks), f"save of {key} reuses blocks being loaded"
        for key, (tid, blocks, shape) in meta.loads.items():
            entry = self.scheduler.allocator.get(key)
            assert entry is not None and entry.ready and entry.pins >= 1
            assert blocks == entry.block_ids and shape == entry.shape
            self.live_loads[tid] = (set(blocks), self.steps, set())
            event("a load was dispatched")
        for rank in range(self.RANKS):
            self.undelivered.append((meta, rank))

    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        if not self.undelivered:
            return
        index = data.draw(st.integers(0, len(self.undelivered) - 1))
        meta, rank = self.undelivered[index]
        if not data.draw(st.booleans()):  # sometimes replay it later as well
            self.undelivered.pop(index)
        report = self.sim.report(meta, ranks=[rank])
        report.reporters = list(range(self.RANKS))
        self.scheduler.update_connector_output(connector_output(report))
        for acked_rank, tid in report.load_acks:
            if tid in self.live_loads:
                self.live_loads[tid][2].add(acked_rank)

    @rule()
    def lose_a_report(self) -> None:
        if self.undelivered:
            self.undelivered.pop(0)

    @invariant()
    def allocator_consistent(self) -> None:
        self.scheduler.allocator.check()

    def teardown(self) -> None:
        # Every report that was not lost arrives; then the bound passes.
        for meta, rank in self.undelivered:
            report = self.sim.report(meta, ranks=[rank])
            report.reporters = list(range(self.RANKS))
            self.scheduler.update_connector_output(connector_output(report))
        self.undelivered.clear()
        for _ in range(TIMEOUT_STEPS + 2):
            self.driver.step([])
        assert not self.scheduler.flights, "a copy is held forever"
        assert not self.scheduler.allocator.has_held_entries(), "an entry is held forever"


class OneRank(SchedulerMachine):
    RANKS = 1


class TwoRanks(SchedulerMachine):
    RANKS = 2


class FourRanks(SchedulerMachine):
    RANKS = 4


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestOneRank = OneRank.TestCase
TestOneRank.settings = _settings
TestTwoRanks = TwoRanks.TestCase
TestTwoRanks.settings = _settings
TestFourRanks = FourRanks.TestCase
TestFourRanks.settings = _settings
