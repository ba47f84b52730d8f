"""What the scheduler opens outside its own memory, and how it closes it.

Runs in the scheduler process, once per scheduler. Three things are opened
here, and nowhere else: the region's reservation file (followed while the
workers reserve the region), the report side channel (`ec_core.report_channel`)
and the remote source (the peer layer, `ec_scheduler.remote`). The
scheduler's constructor builds its in-memory state and then calls
`Connections.open`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ec_core import report_channel
from ec_core._vllm import get_logger
from ec_core.region.reservation import RegionReservation
from ec_core.report_channel import ReportReceiver
from ec_core.scheduler_process.allocator import BlockAllocator
from ec_core.sizes import format_bytes
from ec_scheduler.remote import LocalEntries, RemoteSource, load_remote_source

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from ec_core.layout import RegionLayout
    from ec_core.settings import ECCPUSettings

logger = get_logger(__name__)

_RESERVATION_POLL_S = 0.005
"""How often a step looks at the region's reservation watermark while it moves."""


def serves_peers(settings: ECCPUSettings) -> bool:
    """Whether this engine listens for other engines (`ec_peer_listen`)."""
    return settings.peers is not None and settings.peers.listen is not None


class Connections:
    """The reservation file, the report side channel and the remote source of one scheduler.

    Guarantees:
      * `open` opens the reservation file (when following it), then the side
        channel (when this engine's reports need it), then the remote source
        (when peers are configured); if any of it raises, everything it opened
        is closed before the error propagates. Left to the garbage collector,
        the side channel's ZMQ context may go before its socket, and its
        term() then waits for that socket for ever (the process hangs); until
        then the channel's address stays bound, and building again fails;
      * the side channel exists before the remote source starts, so the source's
        threads see its reports from their first call;
      * `close_files` closes the side channel and the reservation file, and is
        idempotent; the remote source is shut down by the scheduler.
    """

    def __init__(self) -> None:
        self.reservation: RegionReservation | None = None
        """The region's reservation while its watermark may still move."""
        self._reservation_due = 0.0
        self.side_reports: ReportReceiver | None = None
        self.remote: RemoteSource | None = None

    def open(
        self,
        vllm_config: VllmConfig,
        layout: RegionLayout,
        allocator: BlockAllocator,
        *,
        follow_reservation: bool,
        local_entries: Callable[[], LocalEntries],
    ) -> None:
        """Open what this engine's configuration asks for (see the class docstring).

        With `follow_reservation` the allocator is given the blocks reserved so far
        before anything else starts.
        """
        settings = layout.settings
        try:
            if follow_reservation:
                self.reservation = RegionReservation(
                    layout.path,
                    layout.num_blocks,
                    layout.block_size_bytes,
                    engine_id=layout.engine_id,
                    owner=layout.owner,
                )
                self.follow_reservation(allocator)
            if settings.peers is not None:
                if report_channel.needed(vllm_config, listening=serves_peers(settings)):
                    self.side_reports = ReportReceiver(
                        report_channel.endpoint(layout.path), settings.peers.keyring()
                    )
                self.remote = load_remote_source(vllm_config, layout, local_entries())
        except BaseException:
            self.close_files()
            raise

    def follow_reservation(self, allocator: BlockAllocator) -> None:
        """Give `allocator` the blocks reserved since the last look (at most every
        `_RESERVATION_POLL_S`); stop looking once the watermark is final."""
        reservation = self.reservation
        now = time.monotonic()
        if reservation is None or now < self._reservation_due:
            return
        self._reservation_due = now + _RESERVATION_POLL_S
        allocator.extend_reserved(reservation.poll())
        if reservation.final:
            self.reservation = None

    def close_files(self) -> None:
        """Close the side channel and the reservation's file (idempotent)."""
        if self.side_reports is not None:
            self.side_reports.close()
            self.side_reports = None
        if self.reservation is not None:
            self.reservation.close()
            self.reservation = None


def log_configuration(vllm_config: VllmConfig, layout: RegionLayout) -> None:
    """Warn about a role whose engine can never use the tier as configured, and log
    the scheduler's geometry and bounds (debug)."""
    ec_config = vllm_config.ec_transfer_config
    assert ec_config is not None
    settings = layout.settings
    if not serves_peers(settings) and report_channel.drops_reports(vllm_config):
        logger.warning(
            "EC CPU tier role ec_producer without ec_peer_listen: on vLLM's V1 model "
            "runner an encode-only engine never reports its copies, so its entries "
            "never become ready and serve no one. Set ec_peer_listen (and a secret) "
            "to serve consumer engines, or use ec_both for a local CPU tier."
        )
    if ec_config.is_ec_consumer and not ec_config.is_ec_producer and settings.peers is None:
        logger.warning(
            "EC CPU tier role ec_consumer: this engine never saves, and its region "
            "belongs to this engine alone, so nothing will ever be loaded. Use "
            "ec_both for a local CPU tier, or ec_peers to fetch from producers."
        )
    logger.debug(
        "EC CPU tier scheduler: role=%s, %d blocks x %d bytes (%s), policy=%s, "
        "report bound=%d steps and %.1f s",
        ec_config.ec_role,
        layout.num_blocks,
        layout.block_size_bytes,
        format_bytes(layout.nbytes),
        settings.policy,
        settings.report_timeout_steps,
        settings.report_timeout_s,
    )
