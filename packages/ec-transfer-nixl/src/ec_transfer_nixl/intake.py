"""How fetch tasks cross from the scheduler thread to the fetcher thread.

`submit` and `kick` run on the scheduler thread; `take` and `drain_wakes` on
the fetcher thread (both in the scheduler process).
"""

from __future__ import annotations

import contextlib
import queue
import socket as pysocket
import threading
import time
from collections.abc import Callable

from ec_transfer_nixl.tasks import FetchTask

IDLE_POLL_MS = 50
"""How long the fetcher thread waits for work when it has none; also how long a
task submitted with no `kick` waits to be taken on."""


class Intake:
    """The hand-over of tasks from the scheduler thread to the fetcher thread.

    Guarantees: the tasks staged between two `kick`s are taken together, by one
    `take`, however busy the fetcher thread is meanwhile; tasks staged more than
    IDLE_POLL_MS ago with no `kick` (a caller that never kicks) are taken without
    one. Neither `submit` nor `kick` ever blocks, and neither wakes the thread at
    a step's first task (it would then ask for a step's tasks one by one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._inbox: queue.SimpleQueue[list[FetchTask]] = queue.SimpleQueue()
        """Batches handed over by `kick` (each: one step's tasks)."""
        self._staged: list[FetchTask] = []
        """Tasks submitted since the last `kick` (guarded by `_staging`)."""
        self._staged_at = 0.0
        """When the oldest of them was submitted (the fetcher's clock)."""
        self._staging = threading.Lock()
        self._wake_r, self._wake_w = pysocket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    @property
    def wakes(self) -> pysocket.socket:
        """The socket the fetcher thread polls to be woken by `kick` and `wake`."""
        return self._wake_r

    def submit(self, task: FetchTask) -> None:
        """Scheduler thread: stage a task (never blocks)."""
        with self._staging:
            if not self._staged:
                self._staged_at = self._clock()
            self._staged.append(task)

    def kick(self) -> None:
        """Scheduler thread: hand the staged tasks over as one batch and wake the
        fetcher thread (never blocks)."""
        with self._staging:
            batch, self._staged = self._staged, []
        if not batch:
            return
        self._inbox.put(batch)
        self.wake()

    def wake(self) -> None:
        """Wake the fetcher thread's poll."""
        # A full pipe: the thread is awake anyway; a closed one: it has stopped.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def drain_wakes(self) -> None:
        """Fetcher thread: empty the wake-up pipe (after its poll reported it)."""
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass

    def take(self, *, all_staged: bool = False) -> list[FetchTask]:
        """Fetcher thread: the tasks to take on in this pass: every batch `kick` handed
        over, and the staged tasks no `kick` came for within IDLE_POLL_MS (every staged
        one with `all_staged`)."""
        tasks: list[FetchTask] = []
        while True:
            try:
                tasks.extend(self._inbox.get_nowait())
            except queue.Empty:
                break
        if self._staged and (all_staged or self._clock() - self._staged_at >= IDLE_POLL_MS / 1000):
            with self._staging:
                tasks.extend(self._staged)
                self._staged = []
        return tasks

    def close(self) -> None:
        """Close the wake-up pipe (once the fetcher thread has ended)."""
        self._wake_r.close()
        self._wake_w.close()
