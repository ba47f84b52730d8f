"""The device hooks: everything a backend implements, and nothing else.

Runs in worker processes. `ECCPUWorker` (ec_core.worker_process.worker)
calls these; a backend's worker class subclasses it and overrides them. The
copy descriptors and completion handles they exchange are in
`ec_core.worker_process.transfer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ec_core.worker_process.transfer import DescriptorBatch, TransferDirection, TransferHandle


class WorkerHooks:
    """The hooks and their contracts; a backend must fill `_submit_transfer` and
    `_new_device_buffer`, the others have defaults."""

    def _pin_shared_region(self) -> None:
        """Make this process's mapping of the region usable for device copies."""

    def _submit_transfer(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: Sequence[torch.Tensor],
    ) -> TransferHandle:
        """Enqueue every copy of `batch`; return a handle that tells when they landed.

        `keepalive` are the device tensors the copies read (saves) or write
        (loads); the caller holds them until the handle reports completion. A
        hook that raises must first make sure none of its copies can still run
        (drain what it enqueued) and release whatever it acquired: the caller
        then copies the same bytes with `_copy_now`.
        """
        raise NotImplementedError

    def _new_device_buffer(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of `nbytes` on this worker's device (one loaded entry)."""
        raise NotImplementedError

    def _new_entry_buffer(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """The tensor one loaded entry is copied into and vLLM then owns: contiguous,
        of `shape` and `dtype`, in device memory no other live tensor shares.

        The default views a `_new_device_buffer`; a backend overrides it where it
        can build the tensor more cheaply.
        """
        rows, cols = shape
        return self._new_device_buffer(rows * cols * dtype.itemsize).view(dtype).view(rows, cols)

    def _copy_now(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` into `dst` (same number of bytes) and return once it is done.

        The fallback when a batch cannot be submitted. One side is a view of
        the region, the other of a device tensor. `Tensor.copy_` without
        `non_blocking` runs on the current stream and returns only when the
        bytes are in place, which is what every backend needs.
        """
        dst.copy_(src)

    def _shutdown_transfer_backend(self) -> None:
        """Release backend resources; called after all copies landed, before the region goes."""
