"""ec-worker-cuda: the EC CPU tier backend for NVIDIA GPUs (vLLM for CUDA); see its README."""

from ec_scheduler.shell.backends import Backend

BACKEND = Backend(
    "cuda", "ec_worker_cuda.worker:CudaECCPUWorker", "ec-worker-cuda", alias="CudaECCPUConnector"
)
__getattr__ = BACKEND.module_getattr(__name__)
