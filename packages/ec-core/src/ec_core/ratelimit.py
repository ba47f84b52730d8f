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


class RateLimitedWarnings:
    """`warn(tag, message, *args)` logs through `logger` at most once per `period_s` per tag.

    `period_s=math.inf` logs each tag once for the object's lifetime.
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
        self._last[tag] = now
        return True
