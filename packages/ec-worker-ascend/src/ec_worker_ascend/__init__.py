"""ec-worker-ascend: the EC CPU tier backend for Ascend NPUs (vllm-ascend); see its README."""

from ec_scheduler.shell.backends import Backend

BACKEND = Backend(
    "npu",
    "ec_worker_ascend.worker:AscendECCPUWorker",
    "ec-worker-ascend",
    alias="AscendECCPUConnector",
)
__getattr__ = BACKEND.module_getattr(__name__)
