"""Region faults on a real, small tmpfs: a full directory is a clear start-up
error, never a SIGBUS later; a region another file replaced is never deleted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ec_core.region.mapping import ECSharedRegion
from ectools.tmpfs import mounted_tmpfs

MIB = 1 << 20


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (needs the privilege to mount; skipped without it)."""
    with mounted_tmpfs(tmp_path / "shm", 4) as mount_point:
        yield mount_point


def test_a_region_larger_than_the_directory_fails_before_any_file(small_tmpfs: Path) -> None:
    with pytest.raises(ValueError, match=r"\['ec_cpu_bytes'\] asks for .* free") as info:
        ECSharedRegion("big", 8 * MIB // 4096, 4096, directory=small_tmpfs)
    assert "4.00 MiB" in str(info.value) or "MiB free" in str(info.value)
    assert list(small_tmpfs.iterdir()) == []


def test_filling_the_directory_later_never_causes_a_sigbus(small_tmpfs: Path) -> None:
    """The region's pages are reserved at start-up: writing every block after
    the tmpfs filled up works (an unreserved sparse file would SIGBUS)."""
    code = textwrap.dedent(
        f"""
        import os, torch
        from ec_core.region.mapping import ECSharedRegion
        region = ECSharedRegion("full", (2 * {MIB}) // 4096, 4096, directory={str(small_tmpfs)!r})
        # Another process fills the rest of the tmpfs.
        filler = os.open({str(small_tmpfs / "filler")!r}, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            while True:
                os.write(filler, b"x" * 65536)
        except OSError:
            pass
        os.close(filler)
        region.blocks.fill_(7)  # touches every page of the region
        assert int(region.blocks[-1, -1]) == 7
        region.cleanup()
        print("wrote every block")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode != -signal.SIGBUS, "a write into the region faulted"
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote every block" in done.stdout


def test_cleanup_never_deletes_a_file_that_replaced_the_region(tmp_path: Path) -> None:
    region = ECSharedRegion("mine", 4, 4096, directory=tmp_path)
    path = region.path
    os.unlink(path)  # someone removed it and another file took the name
    path.write_bytes(b"not ours")
    path.chmod(0o600)
    region.cleanup()
    assert path.read_bytes() == b"not ours"


def test_a_tmpfs_without_a_size_limit_holds_a_region(tmp_path: Path) -> None:
    """A tmpfs mounted with size=0 (no limit) reports 0 blocks, 0 of them free:
    the region is still made there and every block can be written."""
    with mounted_tmpfs(tmp_path / "unlimited", 0) as mount_point:
        with ECSharedRegion(
            "unlimited", 4 * MIB // 4096, 4096, directory=mount_point, background_reserve=True
        ) as region:
            assert region.wait_reserved(60) and region.reserved_blocks == region.num_blocks
            region.blocks.fill_(7)
        assert list(mount_point.iterdir()) == []
