"""The POSIX shared memory a vLLM engine's processes made, found by process group.

vLLM's multiprocess executor passes its messages through queues in Python's
`multiprocessing.shared_memory` (files `/dev/shm/psm_*`: a broadcast queue of
160 MiB and a response queue of 240 MiB per worker, sparse) and guards its workers
with a named semaphore of the spawn context (`/dev/shm/sem.mp-*`). A clean exit
unlinks them, and so does Python's resource tracker once the processes that made
them are gone; but a SIGKILL of the whole process group, the tests' way to kill
an engine, takes the tracker too, and the files stay until the machine restarts.
The tests and benchmarks that SIGKILL an engine's group remove them afterwards:
`mapped_by_group` while its processes run, then `remove` once they are dead.

Only files some process of the group mapped are taken, each by its inode, so
another engine's, and the region files the tier's own tests look for, are never
touched. vLLM's shared-memory multimodal cache (`vllm_mm_*`, only with
`mm_processor_cache_type="shm"`) is not looked for: no test uses it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from ectools.process_groups import live_members

SHM = Path("/dev/shm")
PREFIXES = ("psm_", "sem.mp-")
"""Python's names for its shared-memory segments and its named semaphores."""


def mapped_by_group(pgid: int) -> dict[Path, int]:
    """The files of `PREFIXES` in `SHM` that a process of group `pgid` maps now,
    with their inodes. Never raises: what cannot be read is left out (empty where
    there is no `/proc`), so a caller about to kill the group always gets to.

    Files are matched by inode, not by the name in `/proc/<pid>/maps`: glibc makes
    a named semaphore under a temporary name, maps it, then links it to its real
    name and unlinks the temporary one, so its mapping reads as a deleted file."""
    inodes: set[int] = set()
    for pid in live_members(pgid):
        # (paths in maps need not be UTF-8)
        with (
            contextlib.suppress(OSError),  # it exited while we looked, or is not ours
            open(f"/proc/{pid}/maps", errors="surrogateescape") as maps,
        ):
            inodes.update(_shm_inodes(maps))
    found: dict[Path, int] = {}
    if inodes:
        with contextlib.suppress(OSError):
            for entry in os.scandir(SHM):
                if entry.name.startswith(PREFIXES) and entry.inode() in inodes:
                    found[Path(entry.path)] = entry.inode()
    return found


def _shm_inodes(maps: Iterable[str]) -> Iterator[int]:
    """The inodes of the files in `SHM` that these `/proc/<pid>/maps` lines map."""
    for line in maps:
        fields = line.rstrip("\n").split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
            yield int(fields[4])


def remove(leftovers: Mapping[Path, int]) -> None:
    """Unlink each path of `leftovers` that still names the same inode (a process
    that still maps one keeps its memory until it exits)."""
    for path, inode in leftovers.items():
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:
                path.unlink()
