"""ECSharedRegion in one process: creation, joining, safety checks, cleanup."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ec_core.region import mapping as region_mod
from ec_core.region import page_reserver
from ec_core.region.files import (
    FILE_PREFIX,
    FILE_SUFFIX,
    HEADER_BYTES,
    RegionError,
    owner_digest,
    region_file_name,
)
from ec_core.region.mapping import ECSharedRegion

BLOCK = 256
BLOCKS = 32


@pytest.fixture
def region_dir(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir()
    return path


@pytest.fixture
def creator(region_dir: Path) -> Iterator[ECSharedRegion]:
    region = ECSharedRegion("1234_dp0", BLOCKS, BLOCK, directory=region_dir, owner="engine-a")
    yield region
    region.cleanup()


def _region_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_creator_makes_a_private_file_of_exact_size(creator: ECSharedRegion) -> None:
    assert creator.is_creator
    st = os.stat(creator.path)
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == HEADER_BYTES + BLOCKS * BLOCK
    assert creator.blocks.shape == (BLOCKS, BLOCK)
    assert creator.blocks.dtype == torch.int8
    assert creator.nbytes == BLOCKS * BLOCK
    assert creator.name.startswith(FILE_PREFIX) and creator.name.endswith(FILE_SUFFIX)


def test_the_file_is_read_write_for_its_owner_whatever_the_umask(region_dir: Path) -> None:
    """A umask that takes the owner's write bit would leave a file the engine's other
    ranks cannot open read-write (a user's shell may set one)."""
    old = os.umask(0o277)
    try:
        with ECSharedRegion("umask", 4, BLOCK, directory=region_dir) as region:
            assert stat.S_IMODE(region.path.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_second_opener_joins_and_shares_bytes(creator: ECSharedRegion) -> None:
    joiner = ECSharedRegion(
        "1234_dp0", BLOCKS, BLOCK, directory=creator.directory, owner="engine-a"
    )
    try:
        assert not joiner.is_creator
        assert joiner.path == creator.path
        creator.blocks[3].fill_(7)
        assert torch.all(joiner.blocks[3] == 7)
        joiner.blocks[5, :4] = torch.tensor([1, 2, 3, 4], dtype=torch.int8)
        assert creator.blocks[5, :4].tolist() == [1, 2, 3, 4]
        assert joiner.base_address != 0
    finally:
        joiner.cleanup()
    assert creator.path.exists(), "a joiner's cleanup must not remove the file"


def test_creator_cleanup_removes_the_file_and_joiner_keeps_working(
    creator: ECSharedRegion,
) -> None:
    joiner = ECSharedRegion(
        "1234_dp0", BLOCKS, BLOCK, directory=creator.directory, owner="engine-a"
    )
    creator.blocks[0].fill_(9)
    creator.cleanup()
    assert not creator.path.exists()
    assert creator.closed
    assert torch.all(joiner.blocks[0] == 9)
    joiner.blocks[1].fill_(1)
    joiner.cleanup()
    assert _region_files(joiner.directory) == []


def test_cleanup_is_idempotent(creator: ECSharedRegion) -> None:
    creator.cleanup()
    creator.cleanup()
    with pytest.raises(RegionError, match="closed"):
        _ = creator.blocks


def test_context_manager_cleans_up(region_dir: Path) -> None:
    with ECSharedRegion("ctx", 4, BLOCK, directory=region_dir) as region:
        assert region.path.exists()
    assert not region.path.exists()


def test_distinct_owners_get_distinct_files(creator: ECSharedRegion) -> None:
    other = ECSharedRegion("1234_dp0", BLOCKS, BLOCK, directory=creator.directory, owner="engine-b")
    try:
        assert other.is_creator
        assert other.path != creator.path
    finally:
        other.cleanup()


@pytest.mark.parametrize(
    "engine_id",
    [
        "../../etc/passwd",
        "a/b/c",
        "",
        ".hidden",
        "x" * 1000,
        "spaces and\nnewlines",
        "ünï/cødé",
        "\x00",
    ],
)
def test_file_name_cannot_escape_the_directory(engine_id: str, region_dir: Path) -> None:
    name = region_file_name(engine_id, owner_digest(engine_id, "", 1, 1))
    assert "/" not in name and "\x00" not in name and not name.startswith(".")
    assert len(name.encode()) < 255
    assert (region_dir / name).parent == region_dir
    with ECSharedRegion(engine_id, 2, BLOCK, directory=region_dir) as region:
        assert region.path.parent == region_dir
        assert region.path.exists()


def test_refuses_a_symlink_at_the_region_name(region_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    name = region_file_name("sym", owner_digest("sym", "", 4, BLOCK))
    (region_dir / name).symlink_to(target)
    with pytest.raises(RegionError, match="symbolic link"):
        ECSharedRegion("sym", 4, BLOCK, directory=region_dir)
    assert target.read_bytes() == b"precious"
    assert (region_dir / name).is_symlink()


def _held_foreign_file(region_dir: Path, engine_id: str, content: bytes, mode: int) -> int:
    """A file at the region's name whose lock is held (so it is not stale)."""
    name = region_file_name(engine_id, owner_digest(engine_id, "", 4, BLOCK))
    path = region_dir / name
    path.write_bytes(content)
    path.chmod(mode)
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def test_refuses_a_live_file_with_a_foreign_header(region_dir: Path) -> None:
    fd = _held_foreign_file(region_dir, "foreign", b"\0" * (HEADER_BYTES + 4 * BLOCK), 0o600)
    try:
        with pytest.raises(RegionError, match="another engine or format"):
            ECSharedRegion("foreign", 4, BLOCK, directory=region_dir)
    finally:
        os.close(fd)


def test_refuses_a_live_file_of_the_wrong_size(region_dir: Path) -> None:
    fd = _held_foreign_file(region_dir, "short", b"\0" * 10, 0o600)
    try:
        with pytest.raises(RegionError, match="geometry needs"):
            ECSharedRegion("short", 4, BLOCK, directory=region_dir)
    finally:
        os.close(fd)


def test_refuses_a_live_file_readable_by_others(region_dir: Path) -> None:
    fd = _held_foreign_file(region_dir, "open", b"\0" * (HEADER_BYTES + 4 * BLOCK), 0o644)
    try:
        with pytest.raises(RegionError, match="is not 0600"):
            ECSharedRegion("open", 4, BLOCK, directory=region_dir)
    finally:
        os.close(fd)


def test_stale_file_without_a_live_holder_is_reclaimed(region_dir: Path) -> None:
    stale = region_dir / f"{FILE_PREFIX}dead_0123456789abcdef{FILE_SUFFIX}"
    stale.write_bytes(b"\0" * 4096)
    stale.chmod(0o600)
    unrelated = region_dir / "someone-elses-file.mmap"
    unrelated.write_bytes(b"keep")
    link = region_dir / f"{FILE_PREFIX}link_0000000000000000{FILE_SUFFIX}"
    link.symlink_to(unrelated)
    with ECSharedRegion("fresh", 4, BLOCK, directory=region_dir):
        assert not stale.exists()
        assert unrelated.read_bytes() == b"keep"
        assert link.is_symlink()


def test_live_region_of_another_engine_is_not_reclaimed(creator: ECSharedRegion) -> None:
    with ECSharedRegion("other", 4, BLOCK, directory=creator.directory):
        assert creator.path.exists()
    assert creator.path.exists()


def test_too_large_for_the_directory_fails_before_any_file(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.fstatvfs

    class Small:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_blocks = 4
            self.f_bavail = 2
            self.f_frsize = st.f_frsize

    monkeypatch.setattr(region_mod.os, "fstatvfs", lambda fd: Small(real(fd)))
    with pytest.raises(ValueError, match=r"\['ec_cpu_bytes'\] asks for 8192 bytes") as info:
        ECSharedRegion("big", 32, BLOCK, directory=region_dir)
    assert "free" in str(info.value)
    assert _region_files(region_dir) == []


def test_a_directory_without_a_size_limit_is_not_refused(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ramfs and a tmpfs mounted with size=0 have no limit and report 0 blocks,
    0 of them free: that is no reason to refuse a region."""
    real = os.fstatvfs

    class Unsized:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_blocks = self.f_bavail = 0
            self.f_frsize = st.f_frsize

    monkeypatch.setattr(region_mod.os, "fstatvfs", lambda fd: Unsized(real(fd)))
    with ECSharedRegion("unsized", BLOCKS, BLOCK, directory=region_dir) as region:
        assert region.is_creator and region.reserved_blocks == BLOCKS
        region.blocks.fill_(3)
    assert _region_files(region_dir) == []
    # Bounded by memory alone: a region larger than the host's memory is refused.
    memory = {"SC_PHYS_PAGES": 2, "SC_PAGE_SIZE": BLOCK}
    monkeypatch.setattr(region_mod.os, "sysconf", memory.__getitem__)
    with pytest.raises(ValueError, match="has no size limit and the host has"):
        ECSharedRegion("too-large", BLOCKS, BLOCK, directory=region_dir)
    assert _region_files(region_dir) == []


@pytest.mark.parametrize("code", [errno.ENOMEM, errno.EFAULT])
def test_a_directory_without_fallocate_that_cannot_hold_the_front_is_a_clear_error(
    code: int, region_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without fallocate the front is reserved by MADV_POPULATE_WRITE; when that finds
    no memory to back it, the start-up error names ec_cpu_bytes like ENOSPC's."""

    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    def no_memory(mapping: object, start: int, length: int) -> None:
        if length > mmap.PAGESIZE:  # the first probe of one page works
            raise OSError(code, os.strerror(code))

    monkeypatch.setattr(region_mod.os, "posix_fallocate", unsupported)
    monkeypatch.setattr(page_reserver, "_populate_write", no_memory)
    with pytest.raises(ValueError, match=r"\['ec_cpu_bytes'\].*cannot hold"):
        ECSharedRegion("nomem", 4, BLOCK, directory=region_dir)
    assert _region_files(region_dir) == []


def test_fallocate_enospc_is_a_clear_error_and_leaves_no_file(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(region_mod.os, "posix_fallocate", no_space)
    with pytest.raises(ValueError, match=r"\['ec_cpu_bytes'\].*cannot hold"):
        ECSharedRegion("full", 4, BLOCK, directory=region_dir)
    assert _region_files(region_dir) == []


def test_a_failed_creation_is_undone_before_the_directory_lock_is_released(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A joiner waiting for the directory lock must never find the half-made file
    (it would report "made by another engine or format", the wrong cause)."""
    lock_held_during_abort: list[bool] = []
    unlink = ECSharedRegion._unlink_if_ours

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def watched_unlink(self: ECSharedRegion) -> None:
        probe = os.open(region_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_held_during_abort.append(True)
        else:
            lock_held_during_abort.append(False)
            fcntl.flock(probe, fcntl.LOCK_UN)
        finally:
            os.close(probe)
        unlink(self)

    monkeypatch.setattr(region_mod.os, "posix_fallocate", no_space)
    monkeypatch.setattr(ECSharedRegion, "_unlink_if_ours", watched_unlink)
    with pytest.raises(ValueError, match="cannot hold"):
        ECSharedRegion("half", 4, BLOCK, directory=region_dir)
    assert lock_held_during_abort == [True]
    assert _region_files(region_dir) == []


def test_madvise_success_uses_two_calls(region_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    real = page_reserver._populate_write

    def spy(mapping: object, start: int, length: int) -> None:
        calls.append((start, length))
        real(mapping, start, length)  # type: ignore[arg-type]

    monkeypatch.setattr(page_reserver, "_populate_write", spy)
    with ECSharedRegion("madv", 4, BLOCK, directory=region_dir) as region:
        assert calls == [(0, region_mod.mmap.PAGESIZE), (0, region.file_bytes)]
        joiner = ECSharedRegion("madv", 4, BLOCK, directory=region_dir)
        joiner.cleanup()
        assert len(calls) == 2, "a joiner must not pre-fault"


def test_madvise_einval_falls_back_to_touching_pages(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch, ec_log: pytest.LogCaptureFixture
) -> None:
    def unsupported(mapping: object, start: int, length: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    touched: list[object] = []
    real_touch = page_reserver._touch_pages

    def spy_touch(mapping: object) -> None:
        touched.append(mapping)
        real_touch(mapping)  # type: ignore[arg-type]

    monkeypatch.setattr(page_reserver, "_populate_write", unsupported)
    monkeypatch.setattr(page_reserver, "_touch_pages", spy_touch)
    with ECSharedRegion("fallback", 4, BLOCK, directory=region_dir) as region:
        assert len(touched) == 1
        region.blocks.fill_(3)
        joiner = ECSharedRegion("fallback", 4, BLOCK, directory=region_dir)
        assert torch.all(joiner.blocks == 3)
        joiner.cleanup()
    assert any("MADV_POPULATE_WRITE" in r.getMessage() for r in ec_log.records)


def test_touch_pages_preserves_bytes(region_dir: Path) -> None:
    with ECSharedRegion("touch", 64, BLOCK, directory=region_dir) as region:
        pattern = torch.arange(64 * BLOCK, dtype=torch.int64).remainder(127).to(torch.int8)
        region.blocks.view(-1).copy_(pattern)
        assert region._mmap is not None
        page_reserver._touch_pages(region._mmap)
        assert torch.equal(region.blocks.view(-1), pattern)


def test_unexpected_madvise_error_propagates_and_leaves_no_file(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def eio(mapping: object, start: int, length: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(page_reserver, "_populate_write", eio)
    with pytest.raises(OSError, match="I/O error"):
        ECSharedRegion("eio", 4, BLOCK, directory=region_dir)
    assert _region_files(region_dir) == []


def test_directory_lock_timeout_is_clear(region_dir: Path) -> None:
    fd = os.open(region_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(TimeoutError, match=r"waited 0 s for the lock on region directory"):
            ECSharedRegion("slow", 4, BLOCK, directory=region_dir, open_timeout_s=0.1)
    finally:
        os.close(fd)
    assert _region_files(region_dir) == []


def test_cleanup_with_a_live_view_warns_instead_of_raising(
    region_dir: Path, ec_log: pytest.LogCaptureFixture
) -> None:
    region = ECSharedRegion("view", 4, BLOCK, directory=region_dir)
    view = region.blocks[1:2]
    region.cleanup()
    assert not region.path.exists()
    assert any("still viewed" in r.getMessage() for r in ec_log.records)
    view.fill_(1)  # the pages stay valid while the view lives
    del view


@pytest.mark.parametrize(("blocks", "size"), [(0, BLOCK), (4, 0), (-1, BLOCK)])
def test_bad_geometry_is_rejected(region_dir: Path, blocks: int, size: int) -> None:
    with pytest.raises(ValueError, match=r"must be positive|at least one block"):
        ECSharedRegion("geom", blocks, size, directory=region_dir)
    assert _region_files(region_dir) == []
