"""A SIGKILLed engine's process group leaves no shared memory of its own behind
(`ectools.shm_leftovers`), and nobody else's is touched. Stand-in processes make
what vLLM's do: a `multiprocessing.shared_memory` segment in the leader and in a
child, and a named semaphore of the spawn context."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from ectools import engine, serving, shm_leftovers

CHILD = """
import signal, sys, time
from multiprocessing import shared_memory
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
segment = shared_memory.SharedMemory(create=True, size=1 << 16)
print(segment.name, flush=True)
time.sleep(120)
"""

LEADER = f"""
import multiprocessing, signal, subprocess, sys, time
from multiprocessing import shared_memory
flags = sys.argv[1:]
if "--ignore-term" in flags:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a server that does not shut down
segment = shared_memory.SharedMemory(create=True, size=1 << 16)
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore: sem.mp-*
child = subprocess.Popen(
    [sys.executable, "-c", {CHILD!r}, *flags], stdout=subprocess.PIPE, text=True
)
names = [segment.name, "sem." + lock._semlock.name.lstrip("/"), child.stdout.readline().strip()]
print(" ".join(names), flush=True)
time.sleep(120)
"""


def _start(*flags: str) -> tuple[subprocess.Popen[str], set[Path]]:
    """The stand-in in a process group of its own, and the files its processes made
    (killed, with them, if they are not all there)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LEADER, *flags],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    with proc.stdout:
        made = {shm_leftovers.SHM / name for name in proc.stdout.readline().split()}
    if len(made) != 3 or not all(path.exists() for path in made):
        engine._kill_group(proc)
        raise AssertionError(f"the stand-in did not make its three files: {made}")
    return proc, made


@pytest.fixture
def someone_elses() -> Iterator[set[Path]]:
    """Files of processes outside the killed group, which must stay: a segment of this
    process, and the three of another stand-in group that keeps running."""
    segment = shared_memory.SharedMemory(create=True, size=1 << 16)
    other, made = _start()
    try:
        yield {shm_leftovers.SHM / segment.name, *made}
    finally:
        engine._kill_group(other)
        segment.close()
        segment.unlink()


def _all_there(paths: set[Path]) -> bool:
    return all(path.exists() for path in paths)


def test_a_killed_engine_group_leaves_none_of_its_shared_memory(
    someone_elses: set[Path],
) -> None:
    proc, made = _start()
    try:
        found = shm_leftovers.mapped_by_group(proc.pid)
        assert made <= found.keys(), "every process of the group is looked at, the child's too"
        assert not someone_elses & found.keys()
    finally:
        engine._kill_group(proc)  # as kill_at and serving() end an engine
    assert not any(path.exists() for path in made)
    assert _all_there(someone_elses)


def test_what_was_found_before_the_caller_killed_the_group_is_removed(
    someone_elses: set[Path],
) -> None:
    """As `serving()` does for a test that kills its engine itself: a dead process
    maps nothing, so what it had made must have been looked up before."""
    proc, made = _start()
    known = shm_leftovers.mapped_by_group(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        # Not reaped (the group's id stays this group's): the leader is a zombie,
        # which maps nothing, once the group has died.
        deadline = time.monotonic() + 60
        while shm_leftovers.mapped_by_group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not shm_leftovers.mapped_by_group(proc.pid)
    finally:
        engine._kill_group(proc, known)
    assert not any(path.exists() for path in made)
    assert _all_there(someone_elses)


def test_a_server_stopped_by_sigkill_leaves_none_of_its_shared_memory(
    someone_elses: set[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "SHUTDOWN_GRACE_S", 0.5)
    proc, made = _start("--ignore-term")  # its child and its child's too
    try:
        serving.stop([proc])  # type: ignore[list-item]  # text mode: the same to stop
    finally:
        if proc.returncode is None:
            engine._kill_group(proc)
    assert proc.returncode == -signal.SIGKILL, "it ignored SIGTERM: stop had to SIGKILL it"
    assert not any(path.exists() for path in made)
    assert _all_there(someone_elses)


def test_a_name_that_names_another_file_by_then_is_left(tmp_path: Path) -> None:
    path = tmp_path / "psm_recreated"
    path.touch()
    shm_leftovers.remove({path: path.stat().st_ino + 1})
    assert path.exists()
    shm_leftovers.remove({path: path.stat().st_ino})
    assert not path.exists()


def test_the_inodes_of_mapped_files_in_shm_are_read_deleted_names_included(
    tmp_path: Path,
) -> None:
    shm = shm_leftovers.SHM
    maps = [
        f"7f00-7f10 rw-s 00000000 00:1a 101 {shm / 'psm_1a2b3c'}\n",
        f"7f10-7f20 rw-s 00000000 00:1a 102 {shm / 'sem.Xk3j9a'} (deleted)\n",
        f"7f20-7f30 rw-s 00000000 08:01 103 {tmp_path / 'psm_elsewhere'}\n",
        "7f30-7f40 rw-p 00000000 00:00 0 \n",
        f"7f40-7f50 r-xp 00000000 08:01 104 {tmp_path / 'libc.so.6'}\n",
    ]
    assert list(shm_leftovers._shm_inodes(maps)) == [101, 102]
