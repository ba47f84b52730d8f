"""Hardware checks for a streamed backend: correctness, bandwidth, registration.

The CUDA and Ascend packages each have a small script (`gpu_checks.py`,
`npu_checks.py`) that describes its device and calls `run_checks`:

1. Round-trips random bf16 encoder outputs of mixed sizes (16 to 16384 rows,
   width 4096) through the backend's real worker — real region, real device
   streams and events — and compares bytes exactly.
2. Measures save (device → region) and load (region → device) bandwidth for
   1, 8 and 64 MB entries, and a plain pinned `tensor.copy_` of the same bytes
   (pinned host tensor ↔ device tensor), and prints the ratio.
3. Measures the host registration of the region.
4. Prints one table; exits 1 on any byte mismatch, 0 otherwise. Without the
   device it prints why and exits 0 (skipped). `--fake` runs the same flow
   over the host-memory fake runtime, to check the script itself on a CPU box
   (its numbers are not device numbers).

Runs offline: the model config is a tiny BLIP-2 config with a 4096-wide text
model, written on the fly (no weights).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

WIDTH = 4096
ROW_BYTES = WIDTH * 2  # bf16
ROUND_TRIP_ROWS = (16, 100, 577, 1024, 4096, 9000, 16384)
BANDWIDTH_MB = (1, 8, 64)


@dataclass
class Device:
    """What the checks need to know about one backend's device."""

    label: str
    """e.g. "CUDA backend GPU checks"."""
    register_call: str
    """The name of the host registration call, for the table."""
    worker_class: type[Any]
    runtime_class: type[Any]
    available: Callable[[], bool]
    device: Callable[[], torch.device]
    synchronize: Callable[[], None]
    describe: Callable[[], str]


def _median(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        began = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def run_checks(spec: Device, argv: list[str] | None = None) -> int:
    """Parse the script's options, run the checks, print the table; the exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller sizes")
    parser.add_argument("--fake", action="store_true", help="host-memory fake runtime (no device)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    if not args.fake and not spec.available():
        print(f"{spec.label}: the device is not available; skipped")
        return 0

    from ec_core.metadata import ECCPUConnectorMetadata
    from ec_core.worker_process.ranks import RankInfo
    from ectools.configs import make_vllm_config
    from ectools.fake_device import FakeDeviceRuntime
    from ectools.tiny_blip2 import TinyBlip2, write_config_only

    def sync() -> None:
        if not args.fake:
            spec.synchronize()

    repeats = 3 if args.quick else args.repeats
    rows_list = ROUND_TRIP_ROWS[:4] if args.quick else ROUND_TRIP_ROWS
    sizes_mb = BANDWIDTH_MB[:2] if args.quick else BANDWIDTH_MB
    device = torch.device("cpu") if args.fake else spec.device()
    region_rows = sum(rows_list) + 2 * max(sizes_mb) * 2**20 // ROW_BYTES + 64
    region_bytes = region_rows * ROW_BYTES

    register_seconds: list[float] = []
    runtime: Any
    if args.fake:
        runtime = FakeDeviceRuntime(synchronous=True)
    else:

        class TimedRuntime(spec.runtime_class):  # type: ignore[name-defined,misc]
            def register_host(self, address: int, nbytes: int) -> None:
                spec.synchronize()
                began = time.perf_counter()
                super().register_host(address, nbytes)
                register_seconds.append(time.perf_counter() - began)

        runtime = TimedRuntime()

    model_dir = write_config_only(
        tempfile.mkdtemp(prefix="ec-device-checks-"), TinyBlip2(text_hidden=WIDTH)
    )
    config = make_vllm_config(
        model_dir,
        dtype="bfloat16",
        extra={
            "ec_cpu_bytes": region_bytes,
            "ec_cpu_dir": tempfile.mkdtemp(prefix="ec-device-region-"),
        },
    )
    worker = spec.worker_class(config, runtime=runtime, rank_info=RankInfo(0, True))
    rows_out: list[tuple[str, str, str, str]] = []
    failures = 0
    try:
        # 1. Byte-exact round trips of mixed sizes.
        torch.manual_seed(0)
        saves: dict[str, list[int]] = {}
        sources: dict[str, torch.Tensor] = {}
        next_block = 0
        for rows in rows_list:
            key = f"rows{rows}"
            sources[key] = torch.randn(rows, WIDTH, device=device).to(torch.bfloat16)
            saves[key] = list(range(next_block, next_block + rows))
            next_block += rows
        meta = ECCPUConnectorMetadata(
            saves=saves, save_shapes={key: (len(blocks), WIDTH) for key, blocks in saves.items()}
        )
        worker.bind(meta)
        for key in saves:
            worker.save_caches(sources, key, meta)
        worker.get_finished()
        sync()
        report = worker.build_connector_worker_meta()
        assert sorted(report.completed_saves) == sorted(saves), report
        loads = {
            k: (i, blocks, (len(blocks), WIDTH)) for i, (k, blocks) in enumerate(saves.items())
        }
        out: dict[str, torch.Tensor] = {}
        meta = ECCPUConnectorMetadata(loads=loads)
        worker.bind(meta)
        worker.start_load_caches(out, meta)
        worker.get_finished()
        sync()
        worker.build_connector_worker_meta()
        for key, source in sources.items():
            same = out[key].shape == source.shape and bool(
                torch.equal(out[key].view(torch.int16), source.view(torch.int16))
            )
            failures += 0 if same else 1
            rows_out.append((f"round trip {key}", "bytes", "exact" if same else "MISMATCH", ""))

        # 2. Bandwidth against a plain pinned copy of the same bytes.
        for mb in sizes_mb:
            nbytes = mb * 2**20
            rows = nbytes // ROW_BYTES
            blocks = list(range(next_block, next_block + rows))
            source = torch.randn(rows, WIDTH, device=device).to(torch.bfloat16)
            pinned = torch.empty(rows, WIDTH, dtype=torch.bfloat16, pin_memory=not args.fake)
            save_meta = ECCPUConnectorMetadata(
                saves={"bw": blocks}, save_shapes={"bw": (rows, WIDTH)}
            )
            load_meta = ECCPUConnectorMetadata(loads={"bw": (0, blocks, (rows, WIDTH))})
            loaded: dict[str, torch.Tensor] = {}

            def save(meta: ECCPUConnectorMetadata = save_meta, src: torch.Tensor = source) -> None:
                worker.bind(meta)
                worker.save_caches({"bw": src}, "bw", meta)
                worker.get_finished()
                sync()
                worker.build_connector_worker_meta()

            def load(
                meta: ECCPUConnectorMetadata = load_meta, sink: dict[str, torch.Tensor] = loaded
            ) -> None:
                sink.clear()
                worker.bind(meta)
                worker.start_load_caches(sink, meta)
                worker.get_finished()
                sync()
                worker.build_connector_worker_meta()

            def plain_d2h(dst: torch.Tensor = pinned, src: torch.Tensor = source) -> None:
                dst.copy_(src, non_blocking=True)

            def plain_h2d(dst: torch.Tensor = source, src: torch.Tensor = pinned) -> None:
                dst.copy_(src, non_blocking=True)

            for op, ours, plain in (("save", save, plain_d2h), ("load", load, plain_h2d)):
                ours_s = _median(ours, repeats, sync)
                plain_s = _median(plain, repeats, sync)
                rows_out.append(
                    (
                        f"{op} {mb} MB",
                        f"{nbytes / ours_s / 1e9:.2f} GB/s",
                        f"{nbytes / plain_s / 1e9:.2f} GB/s",
                        f"{plain_s / ours_s:.2f}",
                    )
                )
            same = bool(torch.equal(loaded["bw"].view(torch.int16), source.view(torch.int16)))
            failures += 0 if same else 1
            if not same:
                rows_out.append((f"bandwidth {mb} MB", "bytes", "MISMATCH", ""))

        # 3. Registration time of the region used above.
        if register_seconds:
            rows_out.append(
                (
                    f"{spec.register_call} {region_bytes / 2**20:.0f} MiB",
                    f"{register_seconds[0] * 1e3:.1f} ms",
                    "",
                    "",
                )
            )
        elif not args.fake:
            rows_out.append((spec.register_call, "FAILED (see warning)", "", ""))
    finally:
        worker.shutdown()

    # 4. One table.
    title = spec.label + (" (FAKE runtime: not device numbers)" if args.fake else "")
    print(f"\n{title}")
    if not args.fake:
        print(
            f"{spec.describe()}, torch {torch.__version__}, batched op: "
            f"{'yes' if runtime.has_batch_copy() else 'no (per-copy fallback)'}, "
            f"pinned: {'yes' if register_seconds else 'no'}"
        )
    header = ("check", "worker", "plain pinned copy_", "ratio")
    widths = [max(len(r[i]) for r in [header, *rows_out]) for i in range(4)]
    for row in (header, *rows_out):
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)))
    print(f"\n{'FAILED' if failures else 'OK'}: {failures} mismatch(es)")
    return 1 if failures else 0
