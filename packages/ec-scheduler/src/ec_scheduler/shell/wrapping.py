"""Wrapping a vLLM method once, so that this connector hears of a call vLLM tells it nothing about.

Guarantees: the wrapped method does what the original did, with the same
arguments, result and exceptions, then calls `after(self)` (not when the
original raised); a method already wrapped under the same mark is left as it
is (a second install is a no-op), and so is a class without that method.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def wrap_once(owner: type, name: str, mark: str, after: Callable[[Any], object]) -> bool:
    """Wrap `owner.<name>` to call `after(self)` once it returns; True if this call
    wrapped it, False if `owner` has no such method or it already carries `mark`."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, mark, False):
        return False

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        after(self)
        return result

    setattr(wrapper, mark, True)
    setattr(owner, name, wrapper)
    return True
