"""The CUDA backend without a GPU: contract suite on a fake runtime; the real runtime's edges."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ec_core.worker_process.ranks import RankInfo
from ec_core.worker_process.transfer import DescriptorBatch, TransferDirection
from ec_worker_cuda import runtime as cuda_runtime
from ec_worker_cuda.runtime import CudaRuntimeError, TorchCudaRuntime
from ec_worker_cuda.worker import CudaECCPUWorker
from ectools.backend_checks import (
    check_backend_announcement,
    modules_after_import,
    run_fake_device_checks,
)
from ectools.configs import make_vllm_config
from ectools.streamed_contract import *  # noqa: F403  (the shared backend contract)
from ectools.streamed_contract import Factory, streamed_factory


@pytest.fixture
def make(tiny_model_dir: str, tmp_path: Path) -> Iterator[Factory]:
    yield from streamed_factory(
        CudaECCPUWorker,
        tiny_model_dir,
        tmp_path,
        connector="ECCPUTierConnector",
    )


def test_package_imports_without_cuda_or_torch() -> None:
    heavy = ["torch", "vllm", "ec_worker_cuda.worker"]
    assert modules_after_import(["ec_worker_cuda"], heavy) == []
    # The worker and runtime modules import on a CPU-only host too.
    assert modules_after_import(["ec_worker_cuda.worker", "ec_worker_cuda.runtime"], ["torch"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure")
def test_real_runtime_refuses_clearly_without_cuda(tiny_model_dir: str, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"needs a CUDA device.*ec-worker-cpu"):
        TorchCudaRuntime()
    config = make_vllm_config(
        tiny_model_dir, extra={"ec_cpu_bytes": "64KiB", "ec_cpu_dir": str(tmp_path)}
    )
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaECCPUWorker(config, rank_info=RankInfo(0, True))


class _Cudart:
    def __init__(self, register_rc: int = 0, unregister_rc: int = 0) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.register_rc = register_rc
        self.unregister_rc = unregister_rc

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self.register_rc

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return self.unregister_rc

    def cudaGetErrorString(self, code: int) -> str:
        return "cudaErrorHostMemoryAlreadyRegistered" if code == 712 else "error"


def _bare_runtime(batch_op: Any = None) -> TorchCudaRuntime:
    """A TorchCudaRuntime without the CUDA availability check (CPU-only host)."""
    runtime = object.__new__(TorchCudaRuntime)
    runtime.device = torch.device("cpu")
    runtime._batch_op = batch_op
    return runtime


def test_host_registration_uses_cudart_and_reports_error_codes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cudart = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    runtime = _bare_runtime()
    runtime.register_host(0x1000, 8192)
    runtime.unregister_host(0x1000)
    assert cudart.calls == [("register", 0x1000, 8192, 0), ("unregister", 0x1000)]
    cudart.register_rc = 712
    with pytest.raises(
        CudaRuntimeError,
        match=r"cudaHostRegister returned CUDA error 712 \(cudaErrorHostMemoryAlreadyRegistered\)",
    ):
        runtime.register_host(0x1000, 8192)


def test_batch_copy_passes_int64_pointer_tensors_and_access_order() -> None:
    calls: list[tuple[list[int], list[int], list[int], bool, torch.dtype]] = []

    def op(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, any_order: bool) -> None:
        calls.append((src.tolist(), dst.tolist(), sizes.tolist(), any_order, src.dtype))

    runtime = _bare_runtime(op)
    assert runtime.has_batch_copy()
    batch = DescriptorBatch()
    batch.add(100, 200, 8)
    batch.add(300, 400, 16)
    keep = runtime.batch_copy(batch, TransferDirection.HOST_TO_DEVICE)
    runtime.batch_copy(batch, TransferDirection.DEVICE_TO_HOST)
    assert calls[0] == ([100, 300], [200, 400], [8, 16], True, torch.int64)
    assert calls[1][3] is False, "saves keep stream order: compute just wrote the source"
    assert isinstance(keep, tuple) and len(keep) == 3
    assert not _bare_runtime(None).has_batch_copy()


def test_find_swap_blocks_batch_needs_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoOps:
        def __getattr__(self, name: str) -> Any:
            raise AttributeError(name)

    monkeypatch.setattr(torch.ops, "_C_cache_ops", NoOps(), raising=False)
    assert cuda_runtime.find_swap_blocks_batch() is None


def test_the_backend_announces_itself_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    check_backend_announcement(monkeypatch, "ec_worker_cuda", "cuda")


def test_gpu_checks_script_runs_its_whole_flow_on_the_fake_runtime() -> None:
    out = run_fake_device_checks(Path(__file__).resolve().parents[1] / "gpu_checks.py")
    assert "CUDA backend GPU checks (FAKE runtime" in out
