"""A fake `DeviceRuntime` that performs "device" copies in host memory.

Device tensors are CPU tensors; streams queue operations that run only when
the stream is synchronised or `complete()` is called (or at once with
`synchronous=True`), so tests can observe work in flight. Every call is
logged in `log` so tests can check ordering (who waits for whom, when the
host mapping is registered and released), and failures can be injected,
including a copy that fails on the device after it was enqueued (its
stream's events then raise, as those of a CUDA or NPU stream in error do).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ec_core.worker_process.transfer import DescriptorBatch, TransferDirection


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[Callable[[], None]] = []
        self.executed = 0
        self.error: Exception | None = None
        """Set once a failing copy has run: the stream's events raise it from then on."""

    def run_until(self, position: int) -> None:
        while self.executed < min(position, len(self.ops)):
            self.ops[self.executed]()
            self.executed += 1

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, runtime: FakeDeviceRuntime) -> None:
        self.runtime = runtime
        self.stream: FakeStream | None = None
        self.position = 0

    def record(self) -> None:
        self.stream = self.runtime.current
        self.position = len(self.stream.ops)
        if self.runtime.synchronous:
            self.stream.run_until(self.position)

    def query(self) -> bool:
        if self.stream is None:
            return True
        done = self.stream.executed >= self.position
        if done and self.stream.error is not None:
            raise self.stream.error
        return done

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.position)
            if self.stream.error is not None:
                raise self.stream.error


class FakeDeviceRuntime:
    """Host-memory stand-in for a CUDA/NPU runtime (see module docstring)."""

    name = "FAKE"

    def __init__(
        self,
        *,
        synchronous: bool = False,
        batch: bool = True,
        max_batch_descriptors: int | None = None,
        fail_register: str | None = None,
        fail_unregister: str | None = None,
        fail_batch_call: int | None = None,
        fail_synchronize_device: bool = False,
        fail_device_empty: int | None = None,
        fail_async_batch: int | None = None,
    ) -> None:
        self.synchronous = synchronous
        self.batch = batch
        self.max_batch_descriptors = max_batch_descriptors
        self.fail_register = fail_register
        self.fail_unregister = fail_unregister
        self.fail_batch_call = fail_batch_call
        self.fail_synchronize_device = fail_synchronize_device
        self.fail_device_empty = fail_device_empty
        """Fail the n-th device allocation (1-based), as an out-of-memory would."""
        self.fail_async_batch = fail_async_batch
        """Accept the n-th batch copy call (1-based) but fail it on the device: it copies
        nothing, and its stream's events raise once the stream has reached it."""
        self.device_allocations = 0
        self.compute = FakeStream("compute")
        self.current = self.compute
        self.streams: list[FakeStream] = [self.compute]
        self.registered: dict[int, int] = {}
        self.log: list[tuple[Any, ...]] = []
        self.batch_calls: list[tuple[TransferDirection, int]] = []
        self.single_copies = 0
        self.events_created = 0

    # streams and events
    def current_stream(self) -> FakeStream:
        return self.current

    def new_stream(self) -> FakeStream:
        stream = FakeStream(f"side{len(self.streams)}")
        self.streams.append(stream)
        self.log.append(("new_stream", stream.name))
        return stream

    def new_event(self) -> FakeEvent:
        self.events_created += 1
        return FakeEvent(self)

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def wait_stream(self, waiter: FakeStream, waitee: FakeStream) -> None:
        self.log.append(("wait", waiter.name, waitee.name))

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", stream.name, int(tensor.data_ptr())))

    def synchronize_stream(self, stream: FakeStream) -> None:
        self.log.append(("synchronize_stream", stream.name))
        stream.run_until(len(stream.ops))

    def synchronize_device(self) -> None:
        self.log.append(("synchronize_device",))
        if self.fail_synchronize_device:
            raise RuntimeError("injected device synchronize failure")
        self.complete()

    def complete(self) -> None:
        """Run every queued operation on every stream."""
        for stream in self.streams:
            stream.run_until(len(stream.ops))

    # host registration
    def register_host(self, address: int, nbytes: int) -> None:
        self.log.append(("register_host", address, nbytes))
        if self.fail_register:
            raise RuntimeError(self.fail_register)
        if address in self.registered:
            raise RuntimeError("already registered")
        self.registered[address] = nbytes

    def unregister_host(self, address: int) -> None:
        self.log.append(("unregister_host", address))
        if self.fail_unregister:
            raise RuntimeError(self.fail_unregister)
        if self.registered.pop(address, None) is None:
            raise RuntimeError("not registered")

    # copies
    def has_batch_copy(self) -> bool:
        return self.batch

    def batch_copy(self, batch: DescriptorBatch, direction: TransferDirection) -> object:
        if self.max_batch_descriptors is not None:
            assert len(batch) <= self.max_batch_descriptors, "descriptor limit exceeded"
        self.batch_calls.append((direction, len(batch)))
        self.log.append(("batch_copy", self.current.name, direction.value, len(batch)))
        if self.fail_batch_call is not None and len(self.batch_calls) == self.fail_batch_call:
            raise RuntimeError("injected batch copy failure")
        copies = list(batch)
        stream = self.current
        fails = len(self.batch_calls) == self.fail_async_batch

        def run() -> None:
            if fails:
                stream.error = RuntimeError("injected asynchronous copy failure")
                return
            for src, dst, size in copies:
                ctypes.memmove(dst, src, size)

        self.current.ops.append(run)
        return copies

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.single_copies += 1
        self.log.append(("copy_async", self.current.name, dst.numel()))
        self.current.ops.append(lambda: dst.copy_(src))

    def device_empty(self, nbytes: int) -> torch.Tensor:
        self.device_allocations += 1
        if self.device_allocations == self.fail_device_empty:
            raise RuntimeError("injected device out of memory")
        return torch.empty(nbytes, dtype=torch.uint8)
