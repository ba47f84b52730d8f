"""Asynchronous device backends: the worker hooks in terms of streams and events.

GPU-like backends (CUDA, Ascend) all do the same dance: register the region's
mapping as pinned host memory, submit each batch on a pooled side stream
bracketed by two events, order it against the compute stream, protect the
tensors involved from the caching allocator, and give the stream and events
back once the end event has fired. `StreamedECCPUWorker` implements the
ECCPUWorker hooks that way, in terms of a narrow `DeviceRuntime`; a backend
package supplies only its runtime (the device calls) and its policies.

Nothing here imports a device library: the runtime does.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ec_core._vllm import get_logger
from ec_core.sizes import format_bytes
from ec_core.worker_process.ranks import RankInfo
from ec_core.worker_process.transfer import DescriptorBatch, TransferDirection
from ec_core.worker_process.worker import ECCPUWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from ec_core.layout import RegionLayout

logger = get_logger(__name__)


class DeviceEvent(Protocol):
    """A device event (timing enabled)."""

    def record(self) -> None:
        """Record on the current stream."""

    def query(self) -> bool:
        """True once the work before the record has completed."""

    def synchronize(self) -> None:
        """Block until the work before the record has completed."""


class DeviceRuntime(Protocol):
    """Every device call a streamed worker makes; backends implement it.

    Streams are opaque objects of the runtime. All copy calls enqueue on the
    current stream and never block.
    """

    name: str
    """The device family, for messages ("CUDA", "NPU")."""
    max_batch_descriptors: int | None
    """The batched copy API's descriptor limit per call (None: no limit)."""

    def current_stream(self) -> Any: ...
    def new_stream(self) -> Any: ...
    def new_event(self) -> DeviceEvent: ...
    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        """Make `waiter` wait for everything enqueued on `waitee` so far."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator `stream` uses `tensor`."""

    def synchronize_stream(self, stream: Any) -> None: ...
    def synchronize_device(self) -> None: ...
    def register_host(self, address: int, nbytes: int) -> None:
        """Pin `[address, address + nbytes)` for this device; raise with the reason."""

    def unregister_host(self, address: int) -> None: ...
    def has_batch_copy(self) -> bool:
        """Whether a batched copy API is available (else per-copy fallback)."""

    def batch_copy(self, batch: DescriptorBatch, direction: TransferDirection) -> object:
        """Enqueue all copies of `batch` (within the descriptor limit) in one call.

        Returns whatever must stay alive until the copies have landed (the
        descriptor arrays the runtime handed to the driver), or None.
        """

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue one asynchronous copy between a device and a host byte range."""

    def device_empty(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of `nbytes` on the device."""


class StreamHandle:
    """The handle of one submitted batch: its stream and two events."""

    def __init__(
        self,
        worker: StreamedECCPUWorker,
        stream: Any,
        start: DeviceEvent,
        end: DeviceEvent,
        keep: list[object],
    ) -> None:
        self._worker = worker
        self.stream = stream
        self.start = start
        self.end = end
        self._keep = keep  # descriptor arrays the driver may still read
        self._released = False

    def query(self) -> bool:
        return self.end.query()

    def synchronize(self) -> None:
        self.end.synchronize()

    def elapsed_seconds(self) -> float | None:
        """Device time between the start and end events (timing events)."""
        timer = getattr(self.start, "elapsed_time", None)
        if timer is None:
            return None
        try:
            return float(timer(self.end)) / 1000.0
        except Exception:  # events without timing, or not recorded
            return None

    def release(self) -> None:
        """Give the stream and events back to the worker's pools (once)."""
        if not self._released:
            self._released = True
            self._keep.clear()
            self._worker._give_back(self.stream, (self.start, self.end))


class StreamedECCPUWorker(ECCPUWorker):
    """ECCPUWorker hooks for devices with streams, events and pinned host memory.

    Guarantees, on top of ECCPUWorker's:
      * one submission per direction per step, on a pooled side stream, between
        a start and an end event; both directions start after the work already
        enqueued on the compute stream (a save reads what compute produced; a
        load writes memory compute may just have released), and the compute
        stream waits for a load before the embeddings are gathered;
      * the tensors a batch reads or writes are recorded on its stream, so the
        caching allocator cannot hand them out before the copy is done;
      * a submission that fails drains its stream and returns stream and events
        to the pools before re-raising (the common worker then copies the
        entries synchronously on the compute stream);
      * shutdown drains the device, unregisters the host mapping, and can run
        twice; a registration failure is one loud warning, and copies then take
        the per-copy path that is safe for pageable memory.
    """

    batch_needs_pinned_host: ClassVar[bool] = True
    """Use the batched API only over registered memory (per-copy path otherwise)."""
    registers_whole_region: ClassVar[bool] = True
    """The whole mapping is pinned right after the region opens, so the region is
    reserved in full before that (see ECCPUWorker)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        *,
        runtime: DeviceRuntime | None = None,
        layout: RegionLayout | None = None,
        rank_info: RankInfo | None = None,
    ) -> None:
        # Set before ECCPUWorker.__init__, which calls _pin_shared_region().
        self.runtime: DeviceRuntime = runtime if runtime is not None else self._make_runtime()
        self._registered: int | None = None
        self._stream_pool: list[Any] = []
        self._event_pool: list[DeviceEvent] = []
        self._backend_closed = False
        super().__init__(vllm_config, layout=layout, rank_info=rank_info)

    def _make_runtime(self) -> DeviceRuntime:
        """The device runtime of this backend (the backend package provides it)."""
        raise NotImplementedError

    @property
    def is_pinned(self) -> bool:
        return self._registered is not None

    # -------------------------------------------------------------- pinning

    def _pin_shared_region(self) -> None:
        address = self.region.base_address
        # The mapping extends to a page boundary, so rounding up stays inside it
        # (some runtimes refuse sizes that are not page multiples).
        nbytes = -(-self.region.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            self.runtime.register_host(address, nbytes)
        except Exception as exc:
            logger.warning(
                "EC CPU tier: registering the %s region mapping (%s) as pinned %s host "
                "memory failed: %s. Copies still work, but from pageable memory: one "
                "copy call per block run, each staged by the driver and slower, and "
                "loads may stall the host.",
                self.region.path,
                format_bytes(nbytes),
                self.runtime.name,
                exc,
            )
            return
        self._registered = address

    # ---------------------------------------------------------- submission

    def _new_device_buffer(self, nbytes: int) -> torch.Tensor:
        return self.runtime.device_empty(nbytes)

    def _take_stream(self) -> tuple[Any, DeviceEvent, DeviceEvent]:
        stream = self._stream_pool.pop() if self._stream_pool else self.runtime.new_stream()
        events = [
            self._event_pool.pop() if self._event_pool else self.runtime.new_event()
            for _ in range(2)
        ]
        return stream, events[0], events[1]

    def _give_back(self, stream: Any, events: Sequence[DeviceEvent]) -> None:
        if self._backend_closed:
            return
        self._stream_pool.append(stream)
        self._event_pool.extend(events)

    def _submit_transfer(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: Sequence[torch.Tensor],
    ) -> StreamHandle:
        runtime = self.runtime
        stream, start, end = self._take_stream()
        compute = runtime.current_stream()
        keep: list[object] = []
        try:
            runtime.wait_stream(stream, compute)
            for tensor in keepalive:
                runtime.record_stream(tensor, stream)
            with runtime.use_stream(stream):
                start.record()
                self._enqueue(batch, direction, keepalive, keep)
                end.record()
            if direction is TransferDirection.HOST_TO_DEVICE:
                runtime.wait_stream(compute, stream)
        except BaseException:
            # Copies already enqueued may still write into buffers the caller
            # is about to drop: drain the stream before it goes back.
            try:
                runtime.synchronize_stream(stream)
            finally:
                self._give_back(stream, (start, end))
            raise
        return StreamHandle(self, stream, start, end, keep)

    def _enqueue(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: Sequence[torch.Tensor],
        keep: list[object],
    ) -> None:
        runtime = self.runtime
        if runtime.has_batch_copy() and (self.is_pinned or not self.batch_needs_pinned_host):
            limit = runtime.max_batch_descriptors or max(len(batch), 1)
            for chunk in batch.split(limit):
                keep.append(runtime.batch_copy(chunk, direction))
            return
        for dst, src in self._resolve(batch, direction, keepalive):
            runtime.copy_async(dst, src)

    def _resolve(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: Sequence[torch.Tensor],
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Turn raw descriptors back into `(dst, src)` byte views (per-copy path)."""
        region = self.region.blocks.view(-1).view(torch.uint8)
        region_base = self.region.base_address
        spans = sorted(
            (int(t.data_ptr()), t.reshape(-1).view(torch.uint8)) for t in keepalive if t.numel()
        )
        starts = [address for address, _ in spans]

        def device_view(address: int, size: int) -> torch.Tensor:
            index = bisect.bisect_right(starts, address) - 1
            if index < 0:
                raise ValueError(f"address {address:#x} is in no tensor of the batch")
            base, flat = spans[index]
            offset = address - base
            if offset + size > flat.numel():
                raise ValueError(f"copy of {size} bytes at {address:#x} leaves its tensor")
            return flat[offset : offset + size]

        for src, dst, size in batch:
            if direction is TransferDirection.HOST_TO_DEVICE:
                host = region[src - region_base : src - region_base + size]
                yield device_view(dst, size), host
            else:
                host = region[dst - region_base : dst - region_base + size]
                yield host, device_view(src, size)

    # ------------------------------------------------------------ shutdown

    def _shutdown_transfer_backend(self) -> None:
        if self._backend_closed:
            return
        self._backend_closed = True
        try:
            self.runtime.synchronize_device()
        finally:
            self._stream_pool.clear()
            self._event_pool.clear()
            address, self._registered = self._registered, None
            if address is not None:
                self.runtime.unregister_host(address)
