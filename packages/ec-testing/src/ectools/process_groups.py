"""The processes of a process group, read from `/proc` (Linux).

The tests, the demo and the benchmarks start each engine or server in a process
group of its own and stop it as a whole (`ectools.engine`, `ectools.serving`);
this is how they find what is left of one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def process_state(pid: int) -> tuple[str, int] | None:
    """The state letter (`R`, `S`, `Z`, ...) and process group of process `pid`,
    from `/proc/<pid>/stat`; None when there is no such process (any more)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no such process, or it ended while we looked
        return None
    # The command name, in parentheses, may hold spaces and parentheses itself.
    state, _parent, group = text[text.rfind(")") + 2 :].split()[:3]
    return state, int(group)


def live_members(pgid: int) -> Iterator[int]:
    """The pids of group `pgid`'s processes that still run (a zombie, which holds no
    memory, file or lock any more, does not count); none where `/proc` cannot be
    read. Lazy: a caller that needs only the first stops the scan there."""
    try:
        pids = [int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return
    for pid in pids:
        found = process_state(pid)
        if found is not None and found[1] == pgid and found[0] != "Z":
            yield pid
