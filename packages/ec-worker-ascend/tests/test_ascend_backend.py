"""The Ascend backend without an NPU.

The shared contract suite runs against AscendECCPUWorker over the host-memory
fake runtime. `NpuRuntime` itself is driven with a fake `torch.npu` namespace
and a fake libascendcl that performs the copies the real calls describe —
reading the ctypes descriptor arrays and attributes exactly as CANN would —
so the marshalling is checked byte for byte through a real region.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ec_core.metadata import ECCPUConnectorMetadata
from ec_core.worker_process.ranks import RankInfo
from ec_core.worker_process.transfer import DescriptorBatch, TransferDirection
from ec_worker_ascend.runtime import (
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
    ACL_HOST_REG_PINNED,
    ACL_MEM_LOCATION_TYPE_DEVICE,
    ACL_MEM_LOCATION_TYPE_HOST,
    ACL_MEMCPY_DEVICE_TO_HOST,
    MAX_BATCH_DESCRIPTORS,
    AclError,
    AclLibrary,
    NpuRuntime,
)
from ec_worker_ascend.worker import AscendECCPUWorker
from ectools.backend_checks import (
    check_backend_announcement,
    modules_after_import,
    run_fake_device_checks,
)
from ectools.configs import make_vllm_config
from ectools.driving import save_meta
from ectools.streamed_contract import *  # noqa: F403  (the shared backend contract)
from ectools.streamed_contract import WIDTH, Factory, streamed_factory


@pytest.fixture
def make(tiny_model_dir: str, tmp_path: Path) -> Iterator[Factory]:
    yield from streamed_factory(
        AscendECCPUWorker,
        tiny_model_dir,
        tmp_path,
        connector="ECCPUTierConnector",
    )


# ----------------------------------------------------------------- fakes


class FakeNpuStream:
    def __init__(self, handle: int) -> None:
        self.npu_stream = handle
        self.waits: list[int] = []

    def wait_stream(self, other: FakeNpuStream) -> None:
        self.waits.append(other.npu_stream)

    def synchronize(self) -> None:
        return None


class FakeNpuEvent:
    def record(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class FakeNpurt:
    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.calls: list[tuple[Any, ...]] = []

    def npuHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self.code

    def npuHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


class FakeNpu:
    """The parts of `torch.npu` NpuRuntime uses; streams carry integer handles."""

    def __init__(self, npurt: FakeNpurt | None = None) -> None:
        self._handles = iter(range(100, 1000))
        self.compute = FakeNpuStream(next(self._handles))
        self.current = self.compute
        if npurt is not None:
            self.npurt = lambda: npurt
        self.synchronized = 0

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 3

    def current_stream(self) -> FakeNpuStream:
        return self.current

    def Stream(self) -> FakeNpuStream:
        return FakeNpuStream(next(self._handles))

    def Event(self, enable_timing: bool = False) -> FakeNpuEvent:
        return FakeNpuEvent()

    @contextlib.contextmanager
    def stream(self, stream: FakeNpuStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def synchronize(self) -> None:
        self.synchronized += 1


class FakeAcl:
    """A libascendcl stand-in: performs the copies the ctypes arguments describe."""

    def __init__(self, *, batch_code: int = 0, register: bool = True) -> None:
        self.batch_code = batch_code
        self.functions = {"aclrtGetDevice", "aclrtMemcpyAsync", "aclrtMemcpyBatchAsync"}
        if register:
            self.functions |= {"aclrtHostRegisterV2", "aclrtHostUnregister"}
        self.calls: list[tuple[Any, ...]] = []

    def has(self, name: str) -> bool:
        return name in self.functions

    def call(self, name: str, *args: Any) -> int:
        if name == "aclrtGetDevice":
            args[0]._obj.value = 3
            return 0
        if name == "aclrtHostRegisterV2":
            self.calls.append(("register", *args))
            return 0
        if name == "aclrtHostUnregister":
            self.calls.append(("unregister", *args))
            return 0
        if name == "aclrtMemcpyAsync":
            dst, dest_max, src, count, kind, stream = args
            assert dest_max >= count
            self.calls.append(("memcpy", kind, stream, count))
            ctypes.memmove(dst, src, count)
            return 0
        assert name == "aclrtMemcpyBatchAsync"
        dsts, dest_maxs, srcs, sizes, n, attrs, attr_indexes, num_attrs, _, stream = args
        attr = attrs[0]
        self.calls.append(
            (
                "batch",
                n,
                num_attrs,
                attr_indexes[0],
                attr.srcLoc.type,
                attr.dstLoc.type,
                attr.dstLoc.id
                if attr.dstLoc.type == ACL_MEM_LOCATION_TYPE_DEVICE
                else attr.srcLoc.id,
                stream,
            )
        )
        if self.batch_code:
            return self.batch_code
        for i in range(n):
            assert dest_maxs[i] >= sizes[i]
            ctypes.memmove(dsts[i], srcs[i], sizes[i])
        return 0


class HostNpuRuntime(NpuRuntime):
    """NpuRuntime whose "device" buffers are host tensors (no NPU here)."""

    def device_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


@pytest.fixture
def config(tiny_model_dir: str, tmp_path: Path) -> Any:
    return make_vllm_config(
        tiny_model_dir,
        extra={"ec_cpu_bytes": 16384 * WIDTH * 4, "ec_cpu_dir": str(tmp_path)},
        connector="ECCPUTierConnector",
    )


def _round_trip(worker: AscendECCPUWorker, blocks: list[int], rows: int) -> None:
    data = torch.randn(rows, WIDTH)
    meta = save_meta({"k": (blocks, data)})
    worker.bind(meta)
    worker.save_caches({"k": data}, "k", meta)
    worker.get_finished()
    assert worker.build_connector_worker_meta().completed_saves == ["k"]
    out: dict[str, torch.Tensor] = {}
    meta = ECCPUConnectorMetadata(loads={"k": (1, blocks, (rows, WIDTH))})
    worker.bind(meta)
    worker.start_load_caches(out, meta)
    worker.get_finished()
    assert worker.build_connector_worker_meta().load_acks == [(0, 1)]
    assert torch.equal(out["k"], data)


# ------------------------------------------------------------------ tests


def test_acl_batch_round_trip_is_byte_exact_with_the_right_attributes(config: Any) -> None:
    acl = FakeAcl()
    runtime = HostNpuRuntime(npu=FakeNpu(FakeNpurt()), acl=acl, batch_op=None)
    worker = AscendECCPUWorker(config, runtime=runtime, rank_info=RankInfo(0, True))
    try:
        _round_trip(worker, [9, 2, 3, 4, 30], rows=5)
        batches = [c for c in acl.calls if c[0] == "batch"]
        assert len(batches) == 2
        save, load = batches
        # (n, numAttrs, attrsIndexes[0], src type, dst type, device id, stream)
        assert save[1:7] == (3, 1, 0, ACL_MEM_LOCATION_TYPE_DEVICE, ACL_MEM_LOCATION_TYPE_HOST, 3)
        assert load[1:7] == (3, 1, 0, ACL_MEM_LOCATION_TYPE_HOST, ACL_MEM_LOCATION_TYPE_DEVICE, 3)
        assert save[7] != runtime.npu.compute.npu_stream, "copies run on the side stream"
    finally:
        worker.shutdown()


def test_batches_are_split_at_the_descriptor_limit(config: Any) -> None:
    acl = FakeAcl()
    runtime = HostNpuRuntime(npu=FakeNpu(FakeNpurt()), acl=acl, batch_op=None)
    worker = AscendECCPUWorker(config, runtime=runtime, rank_info=RankInfo(0, True))
    try:
        rows = MAX_BATCH_DESCRIPTORS + 5
        _round_trip(worker, list(range(0, 2 * rows, 2)), rows=rows)  # one run per block
        sizes = [c[1] for c in acl.calls if c[0] == "batch"]
        assert sizes == [MAX_BATCH_DESCRIPTORS, 5, MAX_BATCH_DESCRIPTORS, 5]
    finally:
        worker.shutdown()


def test_feature_not_supported_falls_back_to_single_async_copies(config: Any) -> None:
    acl = FakeAcl(batch_code=ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
    runtime = HostNpuRuntime(npu=FakeNpu(FakeNpurt()), acl=acl, batch_op=None)
    worker = AscendECCPUWorker(config, runtime=runtime, rank_info=RankInfo(0, True))
    try:
        _round_trip(worker, [0, 1, 7], rows=3)
        kinds = [c[1] for c in acl.calls if c[0] == "memcpy"]
        assert kinds == [ACL_MEMCPY_DEVICE_TO_HOST] * 2, "the save chunk went copy by copy"
        assert len([c for c in acl.calls if c[0] == "batch"]) == 1, "not retried"
        assert not runtime.has_batch_copy()
    finally:
        worker.shutdown()


def test_other_acl_errors_are_reported_with_name_and_index() -> None:
    runtime = HostNpuRuntime(npu=FakeNpu(), acl=FakeAcl(batch_code=107000), batch_op=None)
    batch = DescriptorBatch()
    buffer = torch.zeros(8, dtype=torch.uint8)
    batch.add(buffer.data_ptr(), buffer.data_ptr(), 4)
    with pytest.raises(
        AclError,
        match=r"aclrtMemcpyBatchAsync returned ACL error 107000 \(invalid parameter\) at copy 0",
    ):
        runtime.batch_copy(batch, TransferDirection.HOST_TO_DEVICE)


def test_registration_prefers_npurt_with_the_pinned_flag(config: Any) -> None:
    npurt = FakeNpurt()
    acl = FakeAcl()
    runtime = HostNpuRuntime(npu=FakeNpu(npurt), acl=acl, batch_op=None)
    worker = AscendECCPUWorker(config, runtime=runtime, rank_info=RankInfo(0, True))
    address = worker.region.base_address
    worker.shutdown()
    assert npurt.calls[0][0:2] == ("register", address)
    assert npurt.calls[0][3] == ACL_HOST_REG_PINNED
    assert npurt.calls[1] == ("unregister", address)
    assert not [c for c in acl.calls if c[0] in ("register", "unregister")]


def test_registration_through_libascendcl_when_npurt_is_missing(config: Any) -> None:
    acl = FakeAcl()
    runtime = HostNpuRuntime(npu=FakeNpu(), acl=acl, batch_op=None)
    worker = AscendECCPUWorker(config, runtime=runtime, rank_info=RankInfo(0, True))
    assert worker.is_pinned
    worker.shutdown()
    assert [c[0] for c in acl.calls if c[0] in ("register", "unregister")] == [
        "register",
        "unregister",
    ]
    assert acl.calls[0][3] == ACL_HOST_REG_PINNED


def test_missing_registration_api_warns_once_naming_versions_and_still_copies(
    config: Any, ec_log: pytest.LogCaptureFixture
) -> None:
    runtime = HostNpuRuntime(npu=FakeNpu(), acl=FakeAcl(register=False), batch_op=None)
    worker = AscendECCPUWorker(config, runtime=runtime, rank_info=RankInfo(0, True))
    try:
        assert not worker.is_pinned
        warnings = [r.getMessage() for r in ec_log.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "torch_npu >= 2.13" in warnings[0] and "CANN >= 8.5" in warnings[0]
        assert "pageable" in warnings[0]
    finally:
        worker.shutdown()


def test_npurt_error_codes_are_named(config: Any) -> None:
    runtime = HostNpuRuntime(
        npu=FakeNpu(FakeNpurt(code=507899)), acl=None, batch_op=None, load_acl=False
    )
    with pytest.raises(AclError, match=r"npuHostRegister returned ACL error 507899 \(driver error"):
        runtime.register_host(0x1000, 4096)


@pytest.mark.parametrize(("arity", "expected"), [(4, [(0,), (1,)]), (3, [(), ()])])
def test_vllm_ascend_batch_op_with_and_without_direction(
    arity: int, expected: list[tuple[int, ...]]
) -> None:
    calls: list[tuple[int, ...]] = []

    def op(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, *direction: int) -> None:
        assert src.dtype == dst.dtype == sizes.dtype == torch.int64
        calls.append(direction)

    class Schema:
        arguments = [None] * arity

    op.default = type("Overload", (), {"_schema": Schema()})()  # type: ignore[attr-defined]
    runtime = HostNpuRuntime(npu=FakeNpu(), acl=None, batch_op=op, load_acl=False)
    assert runtime.has_batch_copy()
    batch = DescriptorBatch()
    batch.add(1, 2, 3)
    runtime.batch_copy(batch, TransferDirection.HOST_TO_DEVICE)
    runtime.batch_copy(batch, TransferDirection.DEVICE_TO_HOST)
    assert calls == expected


def test_acl_library_binds_only_symbols_that_exist() -> None:
    class Library:
        aclrtHostUnregister = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda ptr: 0)  # noqa: N815

    acl = AclLibrary(Library())
    assert acl.has("aclrtHostUnregister") and not acl.has("aclrtMemcpyBatchAsync")
    assert acl.call("aclrtHostUnregister", 0) == 0
    assert AclLibrary.load("libdoes-not-exist.so") is None


def test_without_torch_npu_the_worker_fails_clearly_and_leaves_no_region(
    config: Any, tmp_path: Path
) -> None:
    with pytest.raises(RuntimeError, match="needs torch_npu"):
        AscendECCPUWorker(config, rank_info=RankInfo(0, True))
    assert list(tmp_path.glob("ec_cpu_tier_*")) == []


def test_package_imports_without_torch_npu() -> None:
    watch = ["torch", "vllm", "torch_npu"]
    assert modules_after_import(["ec_worker_ascend"], watch) == []
    loaded = modules_after_import(["ec_worker_ascend.runtime", "ec_worker_ascend.worker"], watch)
    assert "torch_npu" not in loaded


def test_the_backend_announces_itself_for_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    check_backend_announcement(monkeypatch, "ec_worker_ascend", "npu")


def test_npu_checks_script_runs_its_whole_flow_on_the_fake_runtime() -> None:
    out = run_fake_device_checks("ectools.npu_checks")
    assert "Ascend backend NPU checks (FAKE runtime" in out
