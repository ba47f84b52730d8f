"""AscendECCPUWorker: the EC CPU tier worker for Ascend NPUs.

The orchestration (pooled NPU streams bracketed by NPU events, ordering
against the compute stream, `record_stream`, failure cleanup that returns
stream and events, shutdown order) is ec-core's `StreamedECCPUWorker`; this
backend supplies the Ascend calls through `NpuRuntime`.
"""

from __future__ import annotations

from ec_core.worker_process.streamed import DeviceRuntime, StreamedECCPUWorker
from ec_worker_ascend.runtime import NpuRuntime


class AscendECCPUWorker(StreamedECCPUWorker):
    """Pinned region (host registration per rank), batched async NPU copies."""

    def _make_runtime(self) -> DeviceRuntime:
        return NpuRuntime()
