"""Parsing of human-written byte sizes (`8e9`, `"512MiB"`, `"8GB"`).

Units are case-insensitive. Decimal units are powers of 1000 (`KB`, `MB`,
`GB`, `TB`), binary units powers of 1024 (`KiB`, `MiB`, `GiB`, `TiB`): `"8GB"`
is 8 000 000 000 bytes and `"8GiB"` is 8 589 934 592 bytes. A bare letter
(`"8G"`) is refused because it is ambiguous between the two.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, DecimalException, InvalidOperation

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(
    r"^\s*(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$"
)


class SizeError(ValueError):
    """A size that cannot be read; the message says why, without the key."""


def parse_byte_size(value: object) -> int:
    """Return `value` as a positive whole number of bytes.

    Accepts ints, integral floats (`8e9`), and strings holding either of those
    or a number with a unit (`"1.5GiB"`). Raises SizeError for everything
    else: bools, NaN/inf, zero, negatives, fractional byte counts, unknown or
    ambiguous units, and any other type.
    """
    if isinstance(value, bool):
        raise SizeError("a boolean is not a size")
    if isinstance(value, int):
        return _positive(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SizeError("the size must be a finite number")
        if not value.is_integer():
            raise SizeError("the size must be a whole number of bytes")
        return _positive(int(value))
    if isinstance(value, str):
        return _parse_text(value)
    raise SizeError(f"expected an int, a float or a string, got {type(value).__name__}")


def _parse_text(text: str) -> int:
    match = _SIZE_RE.match(text)
    if match is None:
        raise SizeError(
            "expected a number of bytes or a number with a unit such as '512MiB', '8GiB' or '8GB'"
        )
    unit = match.group("unit").lower()
    if unit and unit not in _UNITS:
        hint = ""
        if unit in ("k", "m", "g", "t"):
            upper = unit.upper()
            hint = (
                f" ('{upper}' is ambiguous: write '{upper}iB' for 1024-based "
                f"or '{upper}B' for 1000-based)"
            )
        raise SizeError(f"unknown unit {match.group('unit')!r}{hint}")
    try:
        number = Decimal(match.group("number"))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only valid numbers
        raise SizeError("not a number") from exc
    try:
        total = number * _UNITS[unit or "b"]
        whole = total == total.to_integral_value()
    except DecimalException:  # beyond the decimal context's exponent range
        raise SizeError("the size is too large") from None
    if not whole:
        raise SizeError("the size must be a whole number of bytes")
    return _positive(int(total))


_MAX_BYTES = 1 << 62
"""4 EiB: far above any machine's memory, and below what a file offset (a signed
64-bit `off_t`) and the region header's fields can hold."""


def _positive(size: int) -> int:
    if size <= 0:
        raise SizeError("the size must be positive")
    if size > _MAX_BYTES:
        raise SizeError("the size is too large (at most 4 EiB)")
    return size


def format_bytes(size: int) -> str:
    """A short binary-unit rendering for logs, e.g. `1.50 GiB`."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024.0
    return f"{value:.2f} TiB"
