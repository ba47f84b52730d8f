"""The CUDA backend without a GPU: contract suite on a fake runtime; the real runtime's edges."""

from __future__ import annotations

import ctypes
import os
import subprocess
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
    table_rows,
)
from ectools.configs import make_vllm_config
from ectools.streamed_contract import *  # noqa: F403  (the shared backend contract)
from ectools.streamed_contract import Factory, streamed_factory
from ectools.torch_only_env import make_torch_only_venv


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
    """torch.cuda.cudart() as torch binds it (no cudaGetLastError), over one runtime
    instance whose per-thread last error a failed call sets and only
    cudaGetLastError resets (CUDA Runtime API, "Error Handling"); `library()` is
    that instance's libcudart as ctypes sees it."""

    def __init__(self, register_rc: int = 0, unregister_rc: int = 0) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.register_rc = register_rc
        self.unregister_rc = unregister_rc
        self.last_error = 0

    def _returns(self, code: int) -> int:
        if code:
            self.last_error = code
        return code

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self._returns(self.register_rc)

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return self._returns(self.unregister_rc)

    def library(self) -> Any:
        cudart = self

        class Library:
            def cudaGetLastError(self) -> int:
                code, cudart.last_error = cudart.last_error, 0
                return code

        return Library()

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


def test_a_failed_registration_leaves_no_cuda_error_pending(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: str, tmp_path: Path
) -> None:
    """The worker survives a refused registration (a region larger than the driver
    pins, memory already registered) and copies from pageable memory; the error
    must not stay pending either: torch checks each kernel launch with
    cudaGetLastError, so the model's next kernel would raise it."""
    cudart = _Cudart(register_rc=2, unregister_rc=712)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(
        cuda_runtime, "_loaded_libraries", lambda prefix: [cudart.library()], raising=False
    )
    config = make_vllm_config(
        tiny_model_dir, extra={"ec_cpu_bytes": "64KiB", "ec_cpu_dir": str(tmp_path)}
    )
    worker = CudaECCPUWorker(config, runtime=_bare_runtime(), rank_info=RankInfo(0, True))
    try:
        assert not worker.is_pinned and [call[0] for call in cudart.calls] == ["register"]
        assert cudart.last_error == 0, "the refused cudaHostRegister is still pending"
    finally:
        worker.shutdown()
    with pytest.raises(CudaRuntimeError, match="cudaHostUnregister returned CUDA error 712"):
        _bare_runtime().unregister_host(0x1000)
    assert cudart.last_error == 0


def test_loaded_libraries_finds_what_the_process_loaded_and_loads_nothing() -> None:
    (libc,) = cuda_runtime._loaded_libraries("libc.so")
    assert libc.getpid() == os.getpid()
    assert cuda_runtime._loaded_libraries("libno-such-library") == []


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


GPU_CHECKS = "ectools.gpu_checks"


def test_gpu_checks_script_runs_its_whole_flow_on_the_fake_runtime() -> None:
    out = run_fake_device_checks(GPU_CHECKS)
    assert "CUDA backend GPU checks (FAKE runtime" in out
    assert "stand-ins" not in out  # vLLM is installed here: the real names are used


def test_gpu_checks_run_in_a_venv_with_torch_and_nothing_else(tmp_path: Path) -> None:
    """The GPU host has torch and no vLLM, numpy or network: the same command works there."""
    python = str(make_torch_only_venv(tmp_path / "venv"))
    bare = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    probe = subprocess.run(
        [python, "-c", PROBE], check=True, capture_output=True, text=True, cwd=tmp_path, env=bare
    )
    assert probe.stdout.split() == ["torch", "no-vllm", "no-numpy", "no-transformers", "no-ec_core"]
    table = tmp_path / "out" / "gpu-checks.txt"
    out = run_fake_device_checks(GPU_CHECKS, python=python, out=table)
    assert "vLLM is not installed: using labelled stand-ins (ectools.vllm_standins)" in out
    for name in ("vllm.logger.init_logger", "ECConnectorWorkerMetadata", "VllmConfig"):
        assert name in out
    written = table.read_text()
    assert written.startswith("CUDA backend GPU checks (FAKE runtime")
    assert written in out and written.rstrip().endswith("OK: 0 failed check(s)")


PROBE = """
import importlib.util
print("torch" if importlib.util.find_spec("torch") else "no-torch")
for name in ("vllm", "numpy", "transformers", "ec_core"):
    print(name if importlib.util.find_spec(name) else "no-" + name)
"""


def test_gpu_checks_fail_when_a_copy_corrupts_bytes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A check that cannot fail is no check: flip one byte in every batched copy."""
    from ectools import fake_device
    from ectools.device_checks import run_checks
    from ectools.gpu_checks import CUDA

    honest = fake_device.FakeDeviceRuntime.batch_copy

    def corrupting(self: Any, batch: DescriptorBatch, direction: TransferDirection) -> object:
        handle = honest(self, batch, direction)
        _, dst, size = next(iter(batch))
        self.current.ops.append(lambda: ctypes.memset(dst + size - 1, 0x5A, 1))
        return handle

    monkeypatch.setattr(fake_device.FakeDeviceRuntime, "batch_copy", corrupting)
    assert run_checks(CUDA, ["--fake", "--quick"]) == 1
    rows = table_rows(capsys.readouterr().out)
    assert rows["round trips bfloat16 contiguous [batched]"][0] == "MISMATCH"
    assert rows["round trips float32 scrambled [per-run]"][0] == "exact"


def test_the_checks_driver_bindings_need_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    from ectools import cuda_driver

    assert ctypes.sizeof(cuda_driver.MemcpyAttributes) == 24  # CUmemcpyAttributes in cuda.h
    monkeypatch.setattr(cuda_driver, "_load", lambda: None)
    assert cuda_driver.batch_op() is None
    assert cuda_driver.contiguous_copy() is None
