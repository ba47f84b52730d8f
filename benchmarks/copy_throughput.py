"""CPU backend copy throughput vs a plain memcpy of the same bytes.

    hatch run bench-copy [--repeats N]

For entries of 1, 8 and 64 MB (bf16 rows of width 4096, so 8 KiB blocks), it
times a save and a load through the real `CpuECCPUWorker` and a real shared
region — the whole engine step vLLM runs on a worker: `bind`, `save_caches` or
`start_load_caches`, `get_finished`, `build_connector_worker_meta` (descriptor
building, the copy, the report) — and, side by side, one `memcpy`
(`ctypes.memmove`) of the same number of bytes between the same kind of memory:

* save:  encoder output (host tensor) → region;  memcpy tensor → region
* load:  region → a fresh per-entry tensor;      memcpy region → fresh tensor

A loaded entry owns its memory, so the memcpy baseline of a load writes a
freshly allocated tensor; "memcpy warm" copies into memory that was already
touched, which is the ceiling. From 1 MiB on the worker recycles the buffer
of an entry vLLM has freed (here: the previous load of the same entry), so in
steady state it writes warm memory; the `load-new` row times it with nothing
to recycle (the pool keeps nothing: such a load gets fresh memory, pre-faulted
from 32 MiB on), what the first load of a size costs. Medians over the
repeats, all sides timed in turns (the order rotating from round to round).

The `16x1MB` rows time one engine step that saves (loads) 16 entries of 1 MB
each — 16 encoder outputs in one step, each its own run of blocks — against 16
memcpys of 1 MB between the same addresses (16 fresh tensors for a load; 16
warm 1 MB buffers for the warm column): the fixed cost of a step is paid once
for the 16 entries, the per-entry cost 16 times. The single-entry rows above
are unchanged: one 1 MB entry per step against one 1 MB memcpy.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile

import torch

from ec_core.metadata import ECCPUConnectorMetadata
from ec_core.worker_process.ranks import RankInfo
from ec_worker_cpu.worker import CpuECCPUWorker
from ectools.configs import make_vllm_config
from ectools.timing import medians_in_turns
from ectools.tiny_blip2 import TinyBlip2, write_config_only

WIDTH = 4096
SIZES_MB = (1, 8, 64)
BATCH = (16, 1)
"""One step of 16 entries of 1 MB each (the `16x1MB` rows)."""
SHM = "/dev/shm"
"""Where the region lives, as by default (`ec_cpu_dir`): tmpfs. A region on a disk file
system (TMPDIR) would be written back, and its pages write-faulted again after that."""


def measure(worker: CpuECCPUWorker, mb: int, repeats: int, count: int = 1) -> list[str]:
    """Table rows (save, load, load-new) for one step of `count` entries of `mb` MB each."""
    nbytes = mb * 2**20
    rows = nbytes // (WIDTH * 2)
    keys = [f"e{i}" for i in range(count)]
    # Entry i gets blocks [i * rows, (i + 1) * rows): one run each, what the allocator
    # hands out; the metadata carries the runs as the scheduler's does.
    blocks = {key: list(range(i * rows, (i + 1) * rows)) for i, key in enumerate(keys)}
    runs = {key: ((i * rows, rows),) for i, key in enumerate(keys)}
    sources = {key: torch.randn(rows, WIDTH).to(torch.bfloat16) for key in keys}
    save_meta = ECCPUConnectorMetadata(
        saves=blocks, save_shapes=dict.fromkeys(keys, (rows, WIDTH)), runs=runs
    )
    load_meta = ECCPUConnectorMetadata(
        loads={key: (i, blocks[key], (rows, WIDTH)) for i, key in enumerate(keys)}, runs=runs
    )
    region_addr = worker.region.base_address
    block_size = worker.block_size
    spans = [  # (region address, source address) per entry, as the worker copies them
        (region_addr + blocks[key][0] * block_size, sources[key].data_ptr()) for key in keys
    ]
    warm = [torch.zeros(nbytes, dtype=torch.uint8) for _ in keys]
    warm_spans = [
        (buffer.data_ptr(), region) for buffer, (region, _) in zip(warm, spans, strict=True)
    ]

    def save() -> None:
        worker.bind(save_meta)
        for key in keys:
            worker.save_caches(sources, key, save_meta)
        worker.get_finished()
        assert len(worker.build_connector_worker_meta().completed_saves) == count

    loaded: dict[str, torch.Tensor] = {}

    def load() -> None:
        loaded.clear()  # vLLM frees the previous entry before it is loaded again
        worker.bind(load_meta)
        worker.start_load_caches(loaded, load_meta)
        worker.get_finished()
        worker.build_connector_worker_meta()

    def memcpy_save() -> None:
        for region, source in spans:
            ctypes.memmove(region, source, nbytes)

    def memcpy_load_fresh() -> None:
        fresh = []
        for region, _ in spans:
            tensor = torch.empty(nbytes, dtype=torch.uint8)
            ctypes.memmove(tensor.data_ptr(), region, nbytes)
            fresh.append(tensor)

    def memcpy_warm() -> None:
        for buffer, region in warm_spans:
            ctypes.memmove(buffer, region, nbytes)

    def load_new() -> None:
        pool = worker.load_pool
        limit, pool.idle_limit = pool.idle_limit, 0  # nothing freed is kept for reuse
        try:
            load()
        finally:
            pool.idle_limit = limit

    def round_trip_exact() -> bool:
        return len(loaded) == count and all(torch.equal(loaded[k], sources[k]) for k in keys)

    save()
    load()
    assert round_trip_exact(), "round trip must be byte-exact"
    load_new()
    assert round_trip_exact(), "round trip must be byte-exact"
    label = f"{mb}MB" if count == 1 else f"{count}x{mb}MB"
    total = nbytes * count
    lines = []
    for op, ours, base in (
        ("save", save, memcpy_save),
        ("load", load, memcpy_load_fresh),
        ("load-new", load_new, memcpy_load_fresh),
    ):
        ours_s, base_s, warm_s = medians_in_turns([ours, base, memcpy_warm], repeats)
        lines.append(
            f"{label:>7} {op:>8} {total / ours_s / 1e9:>12.2f} {total / base_s / 1e9:>12.2f} "
            f"{base_s / ours_s:>6.2f} {total / warm_s / 1e9:>12.2f} {warm_s / ours_s:>11.2f}"
        )
    return lines


def table(repeats: int = 15) -> list[str]:
    """Table 4 lines: the CPU backend's worker vs memcpy for one 1, 8 or 64 MB entry
    per step, and for a step of 16 entries of 1 MB."""
    torch.set_num_threads(1)
    shm = SHM if os.path.isdir(SHM) else None
    with (
        tempfile.TemporaryDirectory(prefix="ec-bench-region-", dir=shm) as region_dir,
        tempfile.TemporaryDirectory(prefix="ec-bench-model-") as model_dir,
    ):
        return _table(repeats, region_dir, model_dir)


def _table(repeats: int, region_dir: str, model_dir: str) -> list[str]:
    config = make_vllm_config(
        write_config_only(model_dir, TinyBlip2(text_hidden=WIDTH)),
        dtype="bfloat16",
        extra={"ec_cpu_bytes": f"{2 * max(SIZES_MB) + 8}MiB", "ec_cpu_dir": region_dir},
    )
    worker = CpuECCPUWorker(config, rank_info=RankInfo(0, True))
    lines = [
        f"Table 4 - CPU backend copy throughput (block {worker.block_size} B, bf16 x {WIDTH}, "
        f"medians of {repeats}; the in-tree connector has no CPU backend, so the "
        "reference is memcpy; ratio = worker / memcpy of the same kind (a load: into a fresh "
        "tensor); warm ratio = worker / memcpy into memory already touched, the ceiling; load "
        "= steady state: into the recycled buffer of the entry vLLM freed before; "
        "load-new = nothing recycled, a fresh buffer (pre-faulted from 32 MiB on); "
        "16x1MB = one step of 16 entries of 1 MB "
        "vs 16 memcpys of 1 MB; all three timed in turns)",
        f"{'entry':>7} {'op':>8} {'worker GB/s':>12} {'memcpy GB/s':>12} "
        f"{'ratio':>6} {'memcpy warm':>12} {'warm ratio':>11}",
    ]
    try:
        for mb in SIZES_MB:
            lines.extend(measure(worker, mb, repeats))
        lines.extend(measure(worker, BATCH[1], repeats, count=BATCH[0]))
    finally:
        worker.shutdown()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print("\n".join(table(args.repeats)))


if __name__ == "__main__":
    main()
