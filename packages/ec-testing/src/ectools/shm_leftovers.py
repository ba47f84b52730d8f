"""The POSIX shared memory a vLLM engine's processes made, found by process group.

vLLM's processes share their message queues and multimodal caches through Python's
`multiprocessing.shared_memory` (files `/dev/shm/psm_*`) and lock them with its
named semaphores (`/dev/shm/sem.mp-*`). A clean exit unlinks them; a SIGKILLed
engine cannot, and each one leaves about 400 MiB of (sparse) files in /dev/shm until
the machine restarts. The tests and benchmarks that SIGKILL an engine's process
group on purpose remove them afterwards: `mapped_by_group` before the kill, then
`remove` once it is done.

Only files some process of the group has mapped are taken, so another engine's,
or the region files the tier's own tests look for, are never touched.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

SHM = Path("/dev/shm")
PREFIXES = ("psm_", "sem.mp-")
"""Python's names for its shared-memory segments and its named semaphores."""


def mapped_by_group(pgid: int) -> set[Path]:
    """The files of `PREFIXES` in `SHM` that a process of group `pgid` maps now.

    They are matched by inode, not by the name in `/proc/<pid>/maps`: glibc makes a
    named semaphore under a temporary name, maps it, then links it to its real name
    and unlinks the temporary one, so its mapping reads as a deleted file. Empty
    where there is no `/proc`."""
    inodes: set[int] = set()
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if os.getpgid(int(entry.name)) != pgid:
                    continue
                with open(f"/proc/{entry.name}/maps") as maps:
                    inodes.update(_shm_inodes(maps))
            except OSError:  # it exited while we looked (or is not ours to read)
                continue
    if not inodes:
        return set()
    found: set[Path] = set()
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(SHM):
            if entry.name.startswith(PREFIXES) and entry.inode() in inodes:
                found.add(Path(entry.path))
    return found


def _shm_inodes(maps: Iterable[str]) -> Iterator[int]:
    """The inodes of the files in `SHM` that these `/proc/<pid>/maps` lines map."""
    for line in maps:
        fields = line.rstrip("\n").split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
            yield int(fields[4])


def remove(paths: Iterable[Path]) -> None:
    """Unlink each of `paths` still there (a process that still maps one keeps its
    memory until it exits)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
