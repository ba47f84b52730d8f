"""How fast a GPU copies to and from each kind of host memory the tier could use.

    PYTHONPATH=packages/ec-testing/src python -m ectools.host_memory_probe [--out FILE]

Torch with CUDA only; nothing of this project is imported. One table: for each
kind of host buffer (torch's pinned allocation; a `/dev/shm` file mapped
shared and registered with `cudaHostRegister`, which is what the tier's region
is; the same with `MADV_HUGEPAGE`; anonymous mappings, registered), the
median of timed `copy_(non_blocking=True)` host->device and device->host
transfers of 8, 64 and 256 MB, in turns so that clock and load drift touch
every kind alike. It says which kind a gap between the worker and a bare
`copy_` of pinned memory comes from: the memory, or the worker.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
SIZES_MB = (8, 64, 256)
REPEATS = 15


def _sysfs(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as error:
        return f"unreadable ({error.strerror})"


@contextmanager
def _registered(buffer: mmap.mmap) -> Iterator[torch.Tensor]:
    """`buffer` as a uint8 tensor, registered with CUDA while the block runs."""
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    if int(getattr(status, "value", status)) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {status}")
    try:
        yield tensor
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(tensor.data_ptr())
        del tensor


def _touch(buffer: mmap.mmap) -> None:
    """Fault every page in writable (one byte per 4 KiB), as the region's reserver does."""
    view = memoryview(buffer)
    view[::4096] = bytes(len(range(0, len(buffer), 4096)))
    view.release()


def _shm_mapping(nbytes: int, huge: bool) -> tuple[mmap.mmap, Callable[[], None]]:
    fd, name = tempfile.mkstemp(dir="/dev/shm", prefix="ec-probe-")
    os.ftruncate(fd, nbytes)
    buffer = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    if huge:
        buffer.madvise(MADV_HUGEPAGE)
    _touch(buffer)
    return buffer, lambda: os.unlink(name)


def _anonymous(nbytes: int, huge: bool, shared: bool) -> tuple[mmap.mmap, Callable[[], None]]:
    flags = mmap.MAP_ANONYMOUS | (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE)
    buffer = mmap.mmap(-1, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    if huge:
        buffer.madvise(MADV_HUGEPAGE)
    _touch(buffer)
    return buffer, lambda: None


KINDS: dict[str, Callable[[int], tuple[mmap.mmap, Callable[[], None]]] | None] = {
    "torch pinned (cudaHostAlloc)": None,
    "/dev/shm file, registered (the region)": lambda n: _shm_mapping(n, huge=False),
    "/dev/shm file + MADV_HUGEPAGE, registered": lambda n: _shm_mapping(n, huge=True),
    "anonymous shared, registered": lambda n: _anonymous(n, huge=False, shared=True),
    "anonymous private + MADV_HUGEPAGE, registered": lambda n: _anonymous(
        n, huge=True, shared=False
    ),
}


def _time(fn: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def main() -> int:
    """Print (and with `--out`, write) the table; exit 0 without a GPU, saying so."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    largest = max(SIZES_MB) * 2**20
    lines = [
        f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"kernel {platform.release()}",
        "THP enabled: " + _sysfs("/sys/kernel/mm/transparent_hugepage/enabled"),
        "THP shmem_enabled: " + _sysfs("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        f"{'host memory':48} {'MB':>4} {'H2D GB/s':>9} {'D2H GB/s':>9}",
    ]
    for line in lines:
        print(line, flush=True)
    device = torch.empty(largest, dtype=torch.uint8, device="cuda")
    hosts: dict[str, torch.Tensor] = {}
    cleanups: list[Callable[[], None]] = []
    with ExitStack() as stack:
        for kind, make in KINDS.items():
            if make is None:
                hosts[kind] = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
                continue
            try:
                buffer, cleanup = make(largest)
            except (OSError, ValueError) as error:
                print(f"{kind}: skipped ({error})", flush=True)
                continue
            cleanups.append(cleanup)
            hosts[kind] = stack.enter_context(_registered(buffer))
        for mb in SIZES_MB:
            n = mb * 2**20
            times: dict[tuple[str, str], list[float]] = {}
            for _ in range(REPEATS + 2):  # two warm-up turns, dropped below
                for kind, host in hosts.items():
                    h, d = host[:n], device[:n]
                    times.setdefault((kind, "h2d"), []).append(
                        _time(lambda d=d, h=h: d.copy_(h, non_blocking=True))
                    )
                    times.setdefault((kind, "d2h"), []).append(
                        _time(lambda d=d, h=h: h.copy_(d, non_blocking=True))
                    )
            for kind in hosts:
                h2d = statistics.median(times[(kind, "h2d")][2:])
                d2h = statistics.median(times[(kind, "d2h")][2:])
                line = f"{kind:48} {mb:>4} {n / h2d / 1e9:>9.2f} {n / d2h / 1e9:>9.2f}"
                lines.append(line)
                print(line, flush=True)
        hosts.clear()
    for cleanup in cleanups:
        cleanup()
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
