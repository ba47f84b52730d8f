"""Several real processes over one region; a SIGKILLed creator's file is reclaimed."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from ec_core.region.files import FILE_PREFIX
from ec_core.region.mapping import ECSharedRegion

BLOCK = 4096
BLOCKS = 64
PROCS = 4
TIMEOUT = 60

# fork: the children inherit the already imported torch/vLLM modules, so each
# starts in milliseconds instead of re-importing vLLM. A forked child must not
# enter torch's OpenMP pool (it is not fork-safe), hence _child_setup().
CTX = mp.get_context("fork")


def _child_setup() -> None:
    torch.set_num_threads(1)


def _peer(
    directory: str,
    rank: int,
    start: mp.Barrier,
    written: mp.Barrier,
    checked: mp.Barrier,
    out: Connection,
) -> None:
    _child_setup()
    region = ECSharedRegion("mp_dp0", BLOCKS, BLOCK, directory=directory, owner="o")
    start.wait(TIMEOUT)
    # Each rank writes its own stripe of blocks with its own value.
    stripe = BLOCKS // PROCS
    region.blocks[rank * stripe : (rank + 1) * stripe].fill_(rank + 1)
    written.wait(TIMEOUT)
    seen = [int(region.blocks[r * stripe].to(torch.int32).sum()) // BLOCK for r in range(PROCS)]
    checked.wait(TIMEOUT)
    out.send((rank, region.is_creator, seen))
    out.close()
    # Non-creators leave first so the creator's cleanup is the one that unlinks.
    if not region.is_creator:
        region.cleanup()
    written.wait(TIMEOUT)  # reused as a "non-creators are done" barrier
    region.cleanup()


def test_four_processes_share_one_region_and_the_creator_removes_it(tmp_path: Path) -> None:
    start, written, checked = (CTX.Barrier(PROCS) for _ in range(3))
    pipes = [CTX.Pipe(duplex=False) for _ in range(PROCS)]
    procs = [
        CTX.Process(target=_peer, args=(str(tmp_path), r, start, written, checked, pipes[r][1]))
        for r in range(PROCS)
    ]
    for proc in procs:
        proc.start()
    results = [pipes[r][0].recv() for r in range(PROCS)]
    for proc in procs:
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    creators = [rank for rank, is_creator, _ in results if is_creator]
    assert len(creators) == 1, f"exactly one process must create the region, got {creators}"
    for _, _, seen in results:
        assert seen == [1, 2, 3, 4], "every process must see every other process's bytes"
    assert list(tmp_path.iterdir()) == [], "the creator's cleanup must remove the file"


def _hold_region(directory: str, engine_id: str, ready: Connection) -> None:
    _child_setup()
    region = ECSharedRegion(engine_id, BLOCKS, BLOCK, directory=directory)
    region.blocks.fill_(5)
    ready.send(str(region.path))
    ready.close()
    signal.pause()


def _kill_holder(directory: Path, engine_id: str) -> Path:
    recv, send = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=_hold_region, args=(str(directory), engine_id, send))
    proc.start()
    path = Path(recv.recv())
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(TIMEOUT)
    assert proc.exitcode == -signal.SIGKILL
    return path


def test_sigkilled_creator_file_is_reclaimed_by_the_next_engine(tmp_path: Path) -> None:
    stale = _kill_holder(tmp_path, "killed_dp0")
    assert stale.exists(), "SIGKILL leaves the file (nothing could clean up)"
    # A different engine (new instance id) starts on the same host.
    with ECSharedRegion("restarted_dp0", BLOCKS, BLOCK, directory=tmp_path) as region:
        assert region.is_creator
        assert not stale.exists(), "the dead engine's file must be reclaimed"
        assert [p.name for p in tmp_path.iterdir()] == [region.path.name]
    assert list(tmp_path.iterdir()) == []


def test_same_identity_after_sigkill_gets_a_fresh_zeroed_region(tmp_path: Path) -> None:
    stale = _kill_holder(tmp_path, "same_dp0")
    with ECSharedRegion("same_dp0", BLOCKS, BLOCK, directory=tmp_path) as region:
        assert region.is_creator, "a dead owner's file must not be joined"
        assert region.path == stale
        assert int(region.blocks.abs().sum()) == 0, "stale bytes must not leak into a new engine"


def test_a_live_holder_in_another_process_is_never_reclaimed(tmp_path: Path) -> None:
    recv, send = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=_hold_region, args=(str(tmp_path), "alive_dp0", send))
    proc.start()
    try:
        path = Path(recv.recv())
        with ECSharedRegion("other_dp0", BLOCKS, BLOCK, directory=tmp_path):
            assert path.exists()
        joiner = ECSharedRegion("alive_dp0", BLOCKS, BLOCK, directory=tmp_path)
        try:
            assert not joiner.is_creator
            assert int(joiner.blocks[0, 0]) == 5
        finally:
            joiner.cleanup()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(TIMEOUT)
    assert [p.name.startswith(FILE_PREFIX) for p in tmp_path.iterdir()] == [True]


@pytest.mark.parametrize("blocks", [1, 3])
def test_tiny_regions_work_across_processes(tmp_path: Path, blocks: int) -> None:
    with ECSharedRegion("tiny", blocks, 8, directory=tmp_path) as region:
        recv, send = CTX.Pipe(duplex=False)

        def child(out: Connection) -> None:
            _child_setup()
            peer = ECSharedRegion("tiny", blocks, 8, directory=tmp_path)
            peer.blocks[-1].fill_(42)
            out.send(peer.is_creator)
            peer.cleanup()

        proc = CTX.Process(target=child, args=(send,))
        proc.start()
        assert recv.recv() is False
        proc.join(TIMEOUT)
        assert int(region.blocks[-1, 0]) == 42
