"""CPU backend copy throughput vs a plain memcpy of the same bytes.

    hatch run bench-copy [--repeats N]

For entries of 1, 8 and 64 MB (bf16 rows of width 4096, so 8 KiB blocks), it
times a save and a load through the real `CpuECCPUWorker` and a real shared
region — descriptor building, the copy, the report — and, side by side, one
`memcpy` (`ctypes.memmove`) of the same number of bytes between the same kind
of memory:

* save:  encoder output (host tensor) → region;  memcpy tensor → region
* load:  region → a fresh per-entry tensor;      memcpy region → fresh tensor

A loaded entry owns its memory, so the memcpy baseline of a load writes a
freshly allocated tensor; "memcpy warm" copies into memory that was already
touched, which is the ceiling. From 32 MiB on (where glibc maps every
allocation fresh) the worker recycles the buffer of an entry vLLM has freed
(here: the previous load of the same entry), so in steady state it writes
warm memory; the `load-new` row times it with nothing to recycle (the pool
keeps nothing: such a load gets fresh, pre-faulted memory), what the first
load of a size costs. Smaller entries are not pooled, so for them the two
rows time the same path. Medians over the repeats, all sides timed in turns.
"""

from __future__ import annotations

import argparse
import ctypes
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


def measure(worker: CpuECCPUWorker, mb: int, repeats: int) -> list[str]:
    """Table rows (save, load, load-new) for one entry size."""
    nbytes = mb * 2**20
    rows = nbytes // (WIDTH * 2)
    blocks = list(range(rows))  # one run: what the allocator hands out
    source = torch.randn(rows, WIDTH).to(torch.bfloat16)
    save_meta = ECCPUConnectorMetadata(saves={"e": blocks}, save_shapes={"e": (rows, WIDTH)})
    load_meta = ECCPUConnectorMetadata(loads={"e": (0, blocks, (rows, WIDTH))})
    region_addr = worker.region.base_address
    warm = torch.zeros(nbytes, dtype=torch.uint8)

    def save() -> None:
        worker.bind(save_meta)
        worker.save_caches({"e": source}, "e", save_meta)
        worker.get_finished()
        assert worker.build_connector_worker_meta().completed_saves == ["e"]

    loaded: dict[str, torch.Tensor] = {}

    def load() -> None:
        loaded.clear()  # vLLM frees the previous entry before it is loaded again
        worker.bind(load_meta)
        worker.start_load_caches(loaded, load_meta)
        worker.get_finished()
        worker.build_connector_worker_meta()

    def memcpy_save() -> None:
        ctypes.memmove(region_addr, source.data_ptr(), nbytes)

    def memcpy_load_fresh() -> None:
        fresh = torch.empty(nbytes, dtype=torch.uint8)
        ctypes.memmove(fresh.data_ptr(), region_addr, nbytes)

    def memcpy_warm() -> None:
        ctypes.memmove(warm.data_ptr(), region_addr, nbytes)

    def load_new() -> None:
        pool = worker.load_pool
        limit, pool.idle_limit = pool.idle_limit, 0  # nothing freed is kept for reuse
        try:
            load()
        finally:
            pool.idle_limit = limit

    save()
    load()
    assert torch.equal(loaded["e"], source), "round trip must be byte-exact"
    load_new()
    assert torch.equal(loaded["e"], source), "round trip must be byte-exact"
    lines = []
    for op, ours, base in (
        ("save", save, memcpy_save),
        ("load", load, memcpy_load_fresh),
        ("load-new", load_new, memcpy_load_fresh),
    ):
        ours_s, base_s, warm_s = medians_in_turns([ours, base, memcpy_warm], repeats)
        lines.append(
            f"{mb:>5}MB {op:>8} {nbytes / ours_s / 1e9:>12.2f} {nbytes / base_s / 1e9:>12.2f} "
            f"{base_s / ours_s:>6.2f} {nbytes / warm_s / 1e9:>12.2f} {warm_s / ours_s:>11.2f}"
        )
    return lines


def table(repeats: int = 15) -> list[str]:
    """Table 4 lines: the CPU backend's worker vs memcpy for 1, 8 and 64 MB entries."""
    torch.set_num_threads(1)
    region_dir = tempfile.mkdtemp(prefix="ec-bench-region-")
    model_dir = write_config_only(
        tempfile.mkdtemp(prefix="ec-bench-model-"), TinyBlip2(text_hidden=WIDTH)
    )
    config = make_vllm_config(
        model_dir,
        dtype="bfloat16",
        extra={"ec_cpu_bytes": f"{2 * max(SIZES_MB) + 8}MiB", "ec_cpu_dir": region_dir},
    )
    worker = CpuECCPUWorker(config, rank_info=RankInfo(0, True))
    lines = [
        f"Table 4 - CPU backend copy throughput (block {worker.block_size} B, bf16 x {WIDTH}, "
        f"medians of {repeats}; the in-tree connector has no CPU backend, so the "
        "reference is memcpy; ratio = worker / memcpy of the same kind (a load: into a fresh "
        "tensor); warm ratio = worker / memcpy into memory already touched, the ceiling; load "
        "= steady state: from 32 MiB on into the recycled buffer of the entry vLLM freed "
        "before; load-new = nothing recycled, from 32 MiB on a fresh pre-faulted buffer "
        "(below 32 MiB both rows are the same path); all three timed in turns)",
        f"{'entry':>7} {'op':>8} {'worker GB/s':>12} {'memcpy GB/s':>12} "
        f"{'ratio':>6} {'memcpy warm':>12} {'warm ratio':>11}",
    ]
    try:
        for mb in SIZES_MB:
            lines.extend(measure(worker, mb, repeats))
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
