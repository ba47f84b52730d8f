"""Hardware checks for a streamed backend: correctness, registration, throughput, overlap.

`ectools.gpu_checks` (CUDA) and `ectools.npu_checks` (Ascend) each describe
their backend's device and call `run_checks`. One run:

1. **Round trips**, byte-exact, through the backend's real worker (real
   region, registration, streams, events, batched copy): 16 to 16384 rows x
   4096 of bf16, fp16 and fp32, over contiguous and scrambled block ids,
   through the batched path and the per-run path.
2. **Throughput** of save (device → region) and load (region → device) for
   1, 8 and 64 MB entries, per path, interleaved with the same bytes moved by a
   pinned `tensor.copy_` and by one contiguous driver memcpy; ratios to both.
3. **Overlap**: a save on the side stream while matmuls run on the compute
   stream: how much of the shorter one was hidden, and the matmuls' slowdown.
4. **A failed copy**: the batched submission raises; the worker's synchronous
   fallback must still land every byte, and report the fallbacks.
5. **Registration** of 1, 8 and 32 GiB regions (skipped, with the reason,
   where the host lacks the memory or the time budget would be passed).

One table (also written to `--out FILE`); exit 1 on any mismatch or failed
check. Without the device it prints why and exits 0. `--fake` runs the whole
flow on the host-memory fake runtime, to test the script on a CPU box (its
figures are not device figures). Without vLLM the scripts install labelled
stand-ins for the few vLLM names the worker imports (`ectools.vllm_standins`)
and say so; everything on the copy path stays real.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ectools.checkout import ROOT
from ectools.timing import medians_in_turns

WIDTH = 4096
ROUND_TRIP_ROWS = (16, 100, 577, 1024, 4096, 9000, 16384)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BANDWIDTH_MB = (1, 8, 64)
PIN_GIB = (1, 8, 32)
OVERLAP_MB = 256
MATMUL_N = 8192
TIME_BUDGET_S = 170.0
"""Seconds since the process started past which a registration row is skipped (the whole
run, device start-up included, must fit 4 minutes; teardown of the largest region counts)."""


def _process_age() -> float:
    """Seconds since this process started (its CPU time, a lower bound, without /proc)."""
    try:
        with open("/proc/self/stat") as stat:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            return float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.process_time()


PROCESS_STARTED = time.monotonic() - _process_age()
"""When this process started, on the monotonic clock: the budget counts device start-up too."""

ContiguousCopy = Callable[[int, int, int, bool], None]
"""`copy(dst, src, nbytes, to_device)`: one contiguous async memcpy on the current stream."""


@dataclass
class Device:
    """What the checks need to know about one backend's device."""

    label: str
    """e.g. "CUDA backend GPU checks"."""
    register_call: str
    """The name of the host registration call, for the table."""
    worker_class: Callable[[], type[Any]]
    """The backend's worker class (imported on call, after any stand-ins)."""
    make_runtime: Callable[[], tuple[Any, str]]
    """A fresh real runtime, and what its batched copy calls (or why there is none)."""
    available: Callable[[], bool]
    device: Callable[[], torch.device]
    synchronize: Callable[[], None]
    describe: Callable[[], str]
    timing_event: Callable[[], Any]
    """A device event with `record()` and `elapsed_time(other)` in ms."""
    contiguous_copy: Callable[[Any], tuple[ContiguousCopy, str] | None] = lambda runtime: None
    """Given a runtime: the one-memcpy reference and its name, or None if unavailable."""


def prepare_imports() -> bool:
    """Make the product packages importable and, without vLLM, install the stand-ins.

    Call before importing a backend. Returns True when the stand-ins are in use.
    Where `ec_core` is not installed (a device host with torch only, running the
    checks with this package's source on `PYTHONPATH`), the product packages are
    taken from this checkout's `packages/*/src`.
    """
    import importlib.util

    if importlib.util.find_spec("ec_core") is None:
        for src in sorted((ROOT / "packages").glob("*/src")):
            if str(src) not in sys.path:
                sys.path.insert(0, str(src))
    from ectools import vllm_standins

    return vllm_standins.install()


# ------------------------------------------------------------------ the table


@dataclass
class Table:
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    failures: int = 0

    def add(self, check: str, result: str, detail: str = "", *, failed: bool = False) -> None:
        """Record a row, and print it at once: a run cut short still shows what it measured."""
        self.rows.append((check, result, detail))
        self.failures += 1 if failed else 0
        print(f"ROW | {check} | {result} | {detail}", flush=True)

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run one section; an exception becomes a failed row, and the next section runs."""
        try:
            yield
        except Exception as exc:  # a check must report, not die: the device time is scarce
            traceback.print_exc()
            self.add(name, "ERROR", f"{type(exc).__name__}: {exc}", failed=True)

    def render(self) -> list[str]:
        header = ("check", "result", "detail")
        widths = [max(len(r[i]) for r in [header, *self.rows]) for i in range(2)]
        return [
            f"{row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}".rstrip()
            for row in (header, *self.rows)
        ]


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def _tmpfs_mounts() -> set[str]:
    try:
        with open("/proc/mounts") as mounts:
            return {line.split()[1] for line in mounts if line.split()[2] == "tmpfs"}
    except (OSError, IndexError):
        return set()


def _region_dir(nbytes: int, *, memory_only: bool = False) -> str | None:
    """A directory with room for an `nbytes` region file, or None.

    `EC_CHECKS_DIR` first, then /dev/shm, then the temp dir. With
    `memory_only`, only tmpfs (or `EC_CHECKS_DIR`) will do: a large region on
    a disk measures writeback, not registration.
    """
    forced = os.environ.get("EC_CHECKS_DIR")
    candidates = [forced, "/dev/shm", tempfile.gettempdir()]
    tmpfs = _tmpfs_mounts()
    for candidate in candidates:
        if not candidate or not os.path.isdir(candidate):
            continue
        if memory_only and candidate != forced and os.path.realpath(candidate) not in tmpfs:
            continue
        stats = os.statvfs(candidate)
        if stats.f_bavail * stats.f_frsize >= nbytes + 256 * 2**20:
            return candidate
    return None


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _WallEvent:
    """The fake runtime's timing event: host wall time (its copies run at once)."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, other: _WallEvent) -> float:
        return (other.at - self.at) * 1e3


def _host_memmove(dst: int, src: int, nbytes: int, to_device: bool) -> None:
    ctypes.memmove(dst, src, nbytes)


# ------------------------------------------------------------------ the checks


class Checks:
    """One run of the checks (see the module docstring)."""

    def __init__(self, spec: Device, args: argparse.Namespace, standins: bool) -> None:
        from ec_core.metadata import ECCPUConnectorMetadata
        from ec_core.worker_process.ranks import RankInfo

        self.spec = spec
        self.args = args
        self.standins = standins
        self.fake = bool(args.fake)
        self.meta_class = ECCPUConnectorMetadata
        self.rank_info = RankInfo(0, True)
        self.table = Table()
        self.step = 0
        self.device = torch.device("cpu") if self.fake else spec.device()
        self.repeats = 3 if args.quick else args.repeats
        self.rows_list = ROUND_TRIP_ROWS[:4] if args.quick else ROUND_TRIP_ROWS
        self.sizes_mb = BANDWIDTH_MB[:2] if args.quick else BANDWIDTH_MB
        self.overlap_mb = 16 if args.quick else OVERLAP_MB
        self.pin_bytes = [2**26, 2**28] if args.quick else [g * 2**30 for g in PIN_GIB]
        self.register_call = "fake register_host" if self.fake else spec.register_call
        self.batch_label = ""
        self.contiguous_label = ""
        self._dirs: list[str] = []
        self._model_dir: str | None = None

    # ----------------------------------------------------------- plumbing

    def sync(self) -> None:
        if not self.fake:
            self.spec.synchronize()

    def runtime(self) -> tuple[Any, str]:
        if self.fake:
            from ectools.fake_device import FakeDeviceRuntime

            return FakeDeviceRuntime(synchronous=True), "fake (host memmove)"
        return self.spec.make_runtime()

    def event(self) -> Any:
        return _WallEvent() if self.fake else self.spec.timing_event()

    def config(self, dtype: torch.dtype, region_bytes: int, directory: str) -> Any:
        extra = {"ec_cpu_bytes": region_bytes, "ec_cpu_dir": directory}
        if self.standins:
            from ectools import vllm_standins

            return vllm_standins.standin_config(dtype, WIDTH, extra)
        from ectools.configs import make_vllm_config
        from ectools.tiny_blip2 import TinyBlip2, write_config_only

        if self._model_dir is None:
            self._model_dir = str(
                write_config_only(
                    tempfile.mkdtemp(prefix="ec-device-checks-"), TinyBlip2(text_hidden=WIDTH)
                )
            )
        return make_vllm_config(self._model_dir, dtype=str(dtype).split(".")[-1], extra=extra)

    def worker(
        self, dtype: torch.dtype, region_bytes: int, runtime: Any, *, memory_only: bool = False
    ) -> Any:
        base = _region_dir(region_bytes, memory_only=memory_only)
        if base is None:
            raise RuntimeError(f"no directory has {region_bytes / 2**30:.1f} GiB free")
        directory = tempfile.mkdtemp(prefix="ec-device-region-", dir=base)
        self._dirs.append(directory)
        config = self.config(dtype, region_bytes, directory)
        return self.spec.worker_class()(config, runtime=runtime, rank_info=self.rank_info)

    def paths(self, runtime: Any) -> list[str]:
        return ["batched", "per-run"] if runtime.has_batch_copy() else ["per-run"]

    @contextmanager
    def path(self, runtime: Any, name: str, worker: Any = None) -> Iterator[None]:
        """Run the block with the runtime's batched copy on (`batched`) or hidden (`per-run`).

        A `batched` block must call the batched copy: the worker silently
        takes the per-run path when the region is not pinned, and a row that
        names the batched path must not pass without it.
        """
        if name == "batched":
            real = runtime.batch_copy
            calls = [0]

            def counted(*args: Any, **kwargs: Any) -> object:
                calls[0] += 1
                return real(*args, **kwargs)

            runtime.batch_copy = counted
            try:
                yield
            finally:
                del runtime.batch_copy
            if calls[0] == 0:
                pinned = getattr(worker, "is_pinned", None)
                raise RuntimeError(f"the batched copy was never called (region pinned: {pinned})")
            return
        runtime.has_batch_copy = lambda: False
        try:
            yield
        finally:
            del runtime.has_batch_copy

    def next_meta(self, **fields: Any) -> Any:
        self.step += 1
        return self.meta_class(step=self.step, **fields)

    def save(
        self,
        worker: Any,
        sources: dict[str, torch.Tensor],
        saves: dict[str, list[int]],
        runs: dict[str, tuple[tuple[int, int], ...]] | None = None,
    ) -> Any:
        """One step's saves; `runs`, as the scheduler sends them (else the worker finds them)."""
        meta = self.next_meta(
            saves=saves,
            save_shapes={key: tuple(sources[key].shape) for key in saves},
            runs=runs or {},
        )
        worker.bind(meta)
        for key in saves:
            worker.save_caches(sources, key, meta)
        worker.get_finished()
        self.sync()
        return worker.build_connector_worker_meta()

    def load(
        self,
        worker: Any,
        shapes: dict[str, tuple[int, int]],
        saves: dict[str, list[int]],
        runs: dict[str, tuple[tuple[int, int], ...]] | None = None,
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """One step's loads; `runs` as for `save`."""
        loads = {key: (i, blocks, shapes[key]) for i, (key, blocks) in enumerate(saves.items())}
        out: dict[str, torch.Tensor] = {}
        meta = self.next_meta(loads=loads, runs=runs or {})
        worker.bind(meta)
        worker.start_load_caches(out, meta)
        worker.get_finished()
        self.sync()
        return out, worker.build_connector_worker_meta()

    def entries(
        self, dtype: torch.dtype, rows_list: Sequence[int], *, scrambled: bool, seed: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
        """Random entries of those row counts, and block ids for them from block 0 on."""
        generator = torch.Generator().manual_seed(seed)
        pool = list(range(sum(rows_list)))
        if scrambled:
            random.Random(seed).shuffle(pool)
        sources: dict[str, torch.Tensor] = {}
        saves: dict[str, list[int]] = {}
        at = 0
        for rows in rows_list:
            key = f"rows{rows}"
            host = torch.randn(rows, WIDTH, generator=generator).to(dtype)
            sources[key] = host.to(self.device)
            saves[key] = pool[at : at + rows]
            at += rows
        return sources, saves

    @staticmethod
    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and bool(
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )

    def round_trip(
        self, worker: Any, dtype: torch.dtype, rows_list: Sequence[int], scrambled: bool
    ) -> tuple[list[str], Any, Any]:
        """Save then load entries; the keys whose bytes differ, and both reports."""
        sources, saves = self.entries(dtype, rows_list, scrambled=scrambled, seed=self.step)
        save_report = self.save(worker, sources, saves)
        if sorted(save_report.completed_saves) != sorted(saves):
            raise RuntimeError(f"saves not reported: {save_report}")
        shapes = {key: (int(t.shape[0]), int(t.shape[1])) for key, t in sources.items()}
        out, load_report = self.load(worker, shapes, saves)
        bad = [key for key, source in sources.items() if not self.same(out[key], source)]
        return bad, save_report, load_report

    # ----------------------------------------------------------- sections

    def preflight(self) -> None:
        """One tiny batched copy there and back, before anything else relies on the op."""
        from ec_core.worker_process.transfer import DescriptorBatch, TransferDirection

        with self.table.section("preflight: batched copy"):
            runtime, self.batch_label = self.runtime()
            if not runtime.has_batch_copy():
                self.table.add("preflight: batched copy", "skipped", self.batch_label)
                return
            size = 4096
            host = torch.randint(0, 256, (2 * size,), dtype=torch.uint8)
            if not self.fake:
                host = host.pin_memory()
            back = torch.zeros_like(host)
            device = torch.empty(2 * size, dtype=torch.uint8, device=self.device)
            print(f"preflight: calling the batched copy ({self.batch_label})", flush=True)
            stream = runtime.new_stream()
            for direction, src, dst in (
                (TransferDirection.HOST_TO_DEVICE, host, device),
                (TransferDirection.DEVICE_TO_HOST, device, back),
            ):
                batch = DescriptorBatch()
                for half in (0, size):
                    batch.add(src.data_ptr() + half, dst.data_ptr() + half, size)
                with runtime.use_stream(stream):
                    keep = runtime.batch_copy(batch, direction)
                runtime.synchronize_stream(stream)
                del keep
            same = bool(torch.equal(host, back))
            self.table.add(
                "preflight: batched copy 2 x 4 KiB there and back",
                "exact" if same else "MISMATCH",
                self.batch_label,
                failed=not same,
            )

    def round_trips(self) -> None:
        span = f"{min(self.rows_list)}-{max(self.rows_list)} rows x {WIDTH}"
        for dtype in DTYPES:
            name = f"round trips {str(dtype).split('.')[-1]}"
            with self.table.section(name):
                runtime, _ = self.runtime()
                row_bytes = WIDTH * dtype.itemsize
                worker = self.worker(dtype, (sum(self.rows_list) + 64) * row_bytes, runtime)
                try:
                    for path in self.paths(runtime):
                        for scrambled in (False, True):
                            order = "scrambled" if scrambled else "contiguous"
                            with self.path(runtime, path, worker):
                                bad, saved, loaded = self.round_trip(
                                    worker, dtype, self.rows_list, scrambled
                                )
                            fell_back = len(saved.fallbacks) + len(loaded.fallbacks)
                            check = f"{name} {order} [{path}]"
                            detail = f"{len(self.rows_list)} entries, {span}"
                            if bad:
                                self.table.add(check, "MISMATCH", ", ".join(bad), failed=True)
                            elif fell_back:
                                self.table.add(
                                    check,
                                    "exact, but FELL BACK",
                                    f"{fell_back} entries copied synchronously; {detail}",
                                    failed=True,
                                )
                            else:
                                self.table.add(check, "exact", detail)
                finally:
                    worker.shutdown()

    def throughput(self) -> None:
        dtype = torch.bfloat16
        row_bytes = WIDTH * dtype.itemsize
        largest = max(self.sizes_mb) * 2**20
        with self.table.section("throughput"):
            runtime, _ = self.runtime()
            reference = (
                (_host_memmove, "memmove") if self.fake else self.spec.contiguous_copy(runtime)
            )
            self.contiguous_label = reference[1] if reference else "none available"
            worker = self.worker(dtype, largest + 64 * row_bytes, runtime)
            try:
                for path in self.paths(runtime):
                    with self.path(runtime, path, worker):
                        for mb in self.sizes_mb:
                            self._throughput_row(worker, path, mb, reference)
            finally:
                worker.shutdown()

    def _throughput_row(
        self, worker: Any, path: str, mb: int, reference: tuple[ContiguousCopy, str] | None
    ) -> None:
        nbytes = mb * 2**20
        rows = nbytes // (WIDTH * 2)
        blocks = list(range(rows))
        source = torch.randn(rows, WIDTH, device=self.device).to(torch.bfloat16)
        landing = torch.empty_like(source)
        pinned = torch.empty(rows, WIDTH, dtype=torch.bfloat16, pin_memory=not self.fake)
        loaded: dict[str, torch.Tensor] = {}

        # The scheduler sends every entry's runs of consecutive blocks with its ids
        # (its allocator keeps them), so the worker never walks the ids: time that.
        runs = {"bw": ((0, rows),)}

        def save() -> None:
            self.save(worker, {"bw": source}, {"bw": blocks}, runs)

        def load() -> None:
            out, _ = self.load(worker, {"bw": (rows, WIDTH)}, {"bw": blocks}, runs)
            loaded.update(out)

        copies: dict[str, tuple[Callable[[], None], ...]] = {
            "save": (save, lambda: pinned.copy_(source, non_blocking=True)),
            "load": (load, lambda: landing.copy_(pinned, non_blocking=True)),
        }
        if reference is not None:
            memcpy = reference[0]
            copies["save"] += (lambda: memcpy(pinned.data_ptr(), source.data_ptr(), nbytes, False),)
            copies["load"] += (lambda: memcpy(landing.data_ptr(), pinned.data_ptr(), nbytes, True),)
        for op, fns in copies.items():
            medians = medians_in_turns(fns, self.repeats, self.sync)
            ours = medians[0]
            detail = f"{medians[1] / ours:.2f}x copy_ ({_gbps(nbytes, medians[1])})"
            if reference is not None:
                detail += f", {medians[2] / ours:.2f}x {reference[1]} ({_gbps(nbytes, medians[2])})"
            self.table.add(f"{op} {mb} MB [{path}]", _gbps(nbytes, ours), detail)
        if not self.same(loaded["bw"], source):
            self.table.add(f"throughput {mb} MB [{path}] bytes", "MISMATCH", "", failed=True)

    def overlap(self) -> None:
        dtype = torch.bfloat16
        nbytes = self.overlap_mb * 2**20
        rows = nbytes // (WIDTH * 2)
        with self.table.section("overlap"):
            runtime, _ = self.runtime()
            path = self.paths(runtime)[0]
            worker = self.worker(dtype, nbytes + 64 * WIDTH * 2, runtime)
            try:
                size = 256 if self.fake else MATMUL_N
                a = torch.randn(size, size, device=self.device).to(dtype)
                b = torch.randn(size, size, device=self.device).to(dtype)
                c = torch.empty(size, size, device=self.device, dtype=dtype)
                source = torch.randn(rows, WIDTH, device=self.device).to(dtype)
                blocks = list(range(rows))
                runs = {"ov": ((0, rows),)}

                def matmuls(count: int) -> None:
                    for _ in range(count):
                        torch.matmul(a, b, out=c)

                def save() -> None:
                    self.save(worker, {"ov": source}, {"ov": blocks}, runs)

                copy_s, one_mm_s = medians_in_turns(
                    (save, lambda: matmuls(1)),
                    self.repeats,
                    self.sync,
                )
                count = max(1, round(copy_s / one_mm_s))
                (mm_s,) = medians_in_turns((lambda: matmuls(count),), self.repeats, self.sync)
                walls: list[float] = []
                mm_together: list[float] = []
                for _ in range(self.repeats):
                    meta = self.next_meta(saves={"ov": blocks}, save_shapes={"ov": (rows, WIDTH)})
                    self.sync()
                    began = time.perf_counter()
                    worker.bind(meta)
                    worker.save_caches({"ov": source}, "ov", meta)
                    worker.get_finished()  # submits the save on the side stream
                    first, last = self.event(), self.event()
                    first.record()
                    matmuls(count)
                    last.record()
                    self.sync()
                    walls.append(time.perf_counter() - began)
                    mm_together.append(first.elapsed_time(last) / 1e3)
                    worker.build_connector_worker_meta()
                wall = statistics.median(walls)
                together = statistics.median(mm_together)
                hidden = max(0.0, min(1.0, (copy_s + mm_s - wall) / min(copy_s, mm_s)))
                self.table.add(
                    f"overlap: save {self.overlap_mb} MB [{path}] + {count} matmul(s) {size}^2",
                    f"{hidden * 100:.0f} % hidden",
                    f"copy alone {copy_s * 1e3:.2f} ms, matmuls alone {mm_s * 1e3:.2f} ms, "
                    f"together {wall * 1e3:.2f} ms; matmuls {together / mm_s:.2f}x their time "
                    "alone",
                )
            finally:
                worker.shutdown()

    def failed_copy(self) -> None:
        dtype = torch.bfloat16
        rows_list = (100, 577)
        with self.table.section("injected copy failure"):
            runtime, _ = self.runtime()
            path = self.paths(runtime)[0]
            worker = self.worker(dtype, (sum(rows_list) + 64) * WIDTH * 2, runtime)
            hook = "batch_copy" if path == "batched" else "copy_async"
            calls = [0]

            def refuse(*args: Any, **kwargs: Any) -> object:
                calls[0] += 1
                raise RuntimeError(f"injected {hook} failure")

            try:
                setattr(runtime, hook, refuse)
                try:
                    bad, saved, loaded = self.round_trip(worker, dtype, rows_list, True)
                finally:
                    delattr(runtime, hook)
                kinds = [kind for _, kind in saved.fallbacks + loaded.fallbacks]
                detail = (
                    f"{hook} raised {calls[0]}x; fallbacks reported: "
                    f"save {kinds.count('save')}, load {kinds.count('load')}"
                )
                recovered = (
                    not bad
                    and calls[0] > 0
                    and kinds.count("save") == kinds.count("load") == len(rows_list)
                )
                self.table.add(
                    f"injected failure in the {path} copy",
                    "recovered: bytes exact" if recovered else "NOT RECOVERED",
                    detail + (f"; mismatched: {', '.join(bad)}" if bad else ""),
                    failed=not recovered,
                )
            finally:
                worker.shutdown()

    def registration(self) -> None:
        spent_per_byte = 0.0
        for nbytes in self.pin_bytes:
            label = f"{nbytes / 2**30:.0f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
            check = f"register {label} region"
            elapsed = time.monotonic() - PROCESS_STARTED
            projected = spent_per_byte * nbytes
            if elapsed + projected > self.args.budget:
                why = (
                    f"{elapsed:.0f} s spent and {projected:.0f} s projected would pass"
                    if projected
                    else f"{elapsed:.0f} s already spent passes"
                )
                self.table.add(check, "skipped", f"{why} the {self.args.budget:.0f} s budget")
                continue
            if nbytes > _available_memory() // 2:
                self.table.add(check, "skipped", "more than half the available host memory")
                continue
            if _region_dir(nbytes, memory_only=True) is None:
                self.table.add(
                    check, "skipped", "no tmpfs (or EC_CHECKS_DIR) with room for the region file"
                )
                continue
            with self.table.section(check):
                runtime, _ = self.runtime()
                timed = self._time_registration(runtime)
                began = time.perf_counter()
                worker = self.worker(torch.bfloat16, nbytes, runtime, memory_only=True)
                total = time.perf_counter() - began
                try:
                    where = os.path.dirname(str(worker.region.path))
                    if not worker.is_pinned:
                        self.table.add(check, "FAILED", "see the warning above", failed=True)
                    else:
                        self.table.add(
                            check,
                            f"{timed[0] * 1e3:.0f} ms ({_gbps(nbytes, timed[0])})",
                            f"{self.register_call}; region file created and mapped in "
                            f"{total - timed[0]:.1f} s under {os.path.dirname(where)}",
                        )
                finally:
                    worker.shutdown()
                    # Creation, registration and teardown: what the next size costs per byte.
                    spent_per_byte = max(spent_per_byte, (time.perf_counter() - began) / nbytes)

    def _time_registration(self, runtime: Any) -> list[float]:
        """Wrap the runtime's `register_host`: the list it returns gets each call's seconds."""
        register = runtime.register_host
        timed: list[float] = []

        def timed_register(address: int, size: int) -> None:
            self.sync()
            began = time.perf_counter()
            register(address, size)
            timed.append(time.perf_counter() - began)

        runtime.register_host = timed_register
        return timed

    def cleanup(self) -> None:
        for directory in self._dirs:
            shutil.rmtree(directory, ignore_errors=True)


def run_checks(spec: Device, argv: list[str] | None = None, *, standins: bool = False) -> int:
    """Parse the script's options, run the checks, print (and write) the table; the exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller sizes")
    parser.add_argument("--fake", action="store_true", help="host-memory fake runtime (no device)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument(
        "--budget", type=float, default=TIME_BUDGET_S, help="seconds before registration rows skip"
    )
    args = parser.parse_args(argv)

    lines: list[str] = []
    if standins:
        from ectools.vllm_standins import NAMES

        lines.append(
            "vLLM is not installed: using labelled stand-ins (ectools.vllm_standins) for "
            + "; ".join(NAMES)
            + ". The copy path (worker, runtime, registration, streams, events, batched copy) "
            + ("is real." if not args.fake else "is real but for the runtime: this is --fake.")
        )
        print(lines[-1], flush=True)
    if not args.fake and not spec.available():
        print(f"{spec.label}: the device is not available; skipped")
        return 0

    checks = Checks(spec, args, standins)

    def report(final: bool) -> str:
        title = spec.label + (" (FAKE runtime: not device numbers)" if args.fake else "")
        head = [title, *lines]
        if not args.fake:
            head.append(f"{spec.describe()}, torch {torch.__version__}")
        head.append(
            f"batched copy: {checks.batch_label or 'n/a'}; contiguous reference: "
            f"{checks.contiguous_label or 'n/a'}; "
            f"{time.monotonic() - PROCESS_STARTED:.0f} s since the process started"
        )
        head += checks.table.render()
        failures = checks.table.failures
        verdict = f"{'FAILED' if failures else 'OK'}: {failures} failed check(s)"
        head.append(
            "Small entries' ratios include the worker's per-step bookkeeping "
            "(metadata, reports), which a bare copy does not do."
        )
        head.append(verdict if final else f"(incomplete: the run stopped early) {verdict}")
        text = "\n".join(head) + "\n"
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        return text

    try:
        for section in (
            checks.preflight,
            checks.round_trips,
            checks.throughput,
            checks.overlap,
            checks.failed_copy,
            checks.registration,
        ):
            section()
            report(final=False)
            print(
                f"[{time.monotonic() - PROCESS_STARTED:.1f} s] {section.__name__} done", flush=True
            )
    finally:
        checks.cleanup()
    print("\n" + report(final=True), end="")
    return 1 if checks.table.failures else 0
