"""CudaECCPUWorker: the EC CPU tier worker for NVIDIA GPUs.

The orchestration (pooled side streams bracketed by events, ordering against
the compute stream, `record_stream`, failure cleanup, shutdown order) is
ec-core's `StreamedECCPUWorker`; this backend supplies the CUDA calls through
`TorchCudaRuntime`.
"""

from __future__ import annotations

from ec_core.worker_process.streamed import DeviceRuntime, StreamedECCPUWorker
from ec_worker_cuda.runtime import TorchCudaRuntime


class CudaECCPUWorker(StreamedECCPUWorker):
    """Pinned region (`cudaHostRegister` per rank), batched async copies."""

    def _make_runtime(self) -> DeviceRuntime:
        return TorchCudaRuntime()
