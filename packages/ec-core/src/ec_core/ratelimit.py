"""Warnings that repeat are logged at most once per period and tag.

A worker that stopped reporting, or a model whose outputs never fit their
allocation, would otherwise write one line per copy. The lines held back are
counted and the count is added to the next line of the same tag.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

DEFAULT_PERIOD_S = 60.0
MAX_TAGS = 1024
"""Tags remembered at most. A tag may name a peer, and peers can come from client
input (a request's handle), so the oldest tags are forgotten past this many."""


class RateLimitedWarnings:
    """`warn(tag, message, *args)` logs through `logger` at most once per `period_s` per tag.

    `period_s=math.inf` logs each tag once for the object's lifetime. At most
    `MAX_TAGS` tags are remembered (the oldest first forgotten, so one of those may
    log again early): memory stays bounded however many distinct tags come.
    """

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        period_s: float = DEFAULT_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self.period_s = period_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, tag: str, message: str, *args: object) -> bool:
        """Log the warning unless `tag` was logged within the period; True if logged."""
        now = self._clock()
        last = self._last.get(tag, -math.inf)
        if now - last < self.period_s:
            self._held[tag] = self._held.get(tag, 0) + 1
            return False
        held = self._held.pop(tag, 0)
        if held:
            message += " (and %d more like it since the previous warning)"
            args = (*args, held)
        self._logger.warning(message, *args)
        logged = self._last
        logged.pop(tag, None)  # re-inserted at the end: the dict stays oldest-logged first
        logged[tag] = now
        while len(logged) > MAX_TAGS:  # (a held count exists only for a remembered tag)
            oldest = next(iter(logged))
            del logged[oldest]
            self._held.pop(oldest, None)
        return True
