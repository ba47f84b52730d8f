"""`FrequencySketch`: approximate, aging request counts in a fixed number of bytes."""

from __future__ import annotations

import zlib

_HALVE = bytes(value >> 1 for value in range(256))
"""`bytearray.translate` table that halves every counter (the sketch's aging)."""

_SPREAD = 0x9E3779B97F4A7C15F39CC0605CEDC835
"""Odd 128-bit multiplier: row r's index is the top bits of bits [32r, 32r + 32)
of `hash * _SPREAD` (a multiplicative hash modulo 2**(32r + 32) per row)."""


def key_hash(key: str) -> int:
    """CRC-32 of the key's UTF-8 bytes: the same in every process, unlike `hash()`."""
    return zlib.crc32(key.encode())


class FrequencySketch:
    """Approximate, aging request counts in a fixed number of small counters.

    A count-min sketch: `depth` rows of `width` counters (one byte each,
    saturating at `cap`), a key's estimate is the least of its `depth`
    counters, and an increment raises only the counters equal to that least
    value (conservative update). After every `period` increments all counters
    are halved, so popularity fades and counts stay comparable over time.

    Guarantees: memory is exactly `depth * width` bytes, whatever the number of
    distinct keys seen (`width` only ever changes through `resize`, which never
    exceeds `max_width`); an estimate never undercounts a key's increments
    since the last halving (a `resize` keeps every count); every operation is
    O(depth) with one CRC-32 of the key (none for the `*_hash` forms, given
    `key_hash(key)`), halving O(width) once per `period` increments (amortised
    O(1) for `period >= width`). Keys are hashed with CRC-32, not `hash()`, so
    estimates are the same in every process (deterministic benchmarks and
    replays).
    """

    depth = 4
    """Rows of counters (fixed: the index arithmetic is unrolled for four)."""

    def __init__(
        self, width: int, *, max_width: int = 1 << 20, cap: int = 15, period_factor: float = 10.0
    ) -> None:
        self.max_width = min(max(_pow2_at_least(max_width), 16), 1 << 32)
        self.cap = cap
        self.period_factor = period_factor
        self.width = 0
        self.counters = bytearray(self.depth * 16)
        self.period = 1
        self.increments = 0
        self.resets = 0
        self._mask = 15
        self._rows = (0, 0, 0, 0, 0, 0, 0)
        """Row 0's shift, then each further row's shift and offset in `counters`
        (see `resize`): what the index arithmetic reads, in one tuple."""
        self.resize(width)

    def resize(self, width: int) -> None:
        """Use `width` counters a row (a power of two, 16 to `max_width`), keeping the counts.

        Row r's index of a key is the top log2(width) bits of a fixed 32-bit
        field of its hash, so when the width grows by 2**k a key's new index
        `i` satisfies `i >> k == old index`: each old counter is copied to the
        2**k counters that replace it. When it shrinks, merged counters keep
        the largest count. Either way no key's estimate drops. O(new width).
        """
        width = min(max(_pow2_at_least(width), 16), self.max_width)
        if width == self.width:
            return
        counters = self.counters
        old = max(self.width, 16)
        while old < width:  # each byte twice: row r of the old array becomes row r of the new
            doubled = bytearray(2 * len(counters))
            doubled[0::2] = counters
            doubled[1::2] = counters
            counters, old = doubled, old * 2
        while old > width:
            counters, old = bytearray(map(max, counters[0::2], counters[1::2])), old // 2
        self.counters = counters
        self.width = width
        self._mask = width - 1
        bits = width.bit_length() - 1
        self._rows = (32 - bits, 64 - bits, width, 96 - bits, 2 * width, 128 - bits, 3 * width)
        self.period = max(int(self.period_factor * width), 1)

    def estimate(self, key: str) -> int:
        """The key's approximate recent request count (0 to `cap`)."""
        return self.estimate_hash(zlib.crc32(key.encode()))

    def estimate_hash(self, digest: int) -> int:
        """`estimate` of the key whose `key_hash` is `digest`."""
        # This and `increment_hash` are the hot path (an increment per request, an
        # estimate per admission and duel): conditional expressions rather than
        # `min()`, and one tuple for the index arithmetic, cost about a quarter less
        # in CPython (timeit); `test_sketch_matches_its_documented_layout` pins
        # what they compute.
        spread = digest * _SPREAD
        counters, mask = self.counters, self._mask
        s0, s1, o1, s2, o2, s3, o3 = self._rows
        a = counters[(spread >> s0) & mask]
        b = counters[o1 + ((spread >> s1) & mask)]
        c = counters[o2 + ((spread >> s2) & mask)]
        d = counters[o3 + ((spread >> s3) & mask)]
        a = a if a < b else b
        c = c if c < d else d
        return a if a < c else c

    def increment(self, key: str) -> None:
        """Count one request for `key`; halves every counter once per `period`."""
        self.increment_hash(zlib.crc32(key.encode()))

    def increment_hash(self, digest: int) -> None:
        """`increment` of the key whose `key_hash` is `digest`."""
        spread = digest * _SPREAD
        counters, mask = self.counters, self._mask
        s0, s1, o1, s2, o2, s3, o3 = self._rows
        a = (spread >> s0) & mask
        b = o1 + ((spread >> s1) & mask)
        c = o2 + ((spread >> s2) & mask)
        d = o3 + ((spread >> s3) & mask)
        ca, cb, cc, cd = counters[a], counters[b], counters[c], counters[d]
        least = ca if ca < cb else cb
        other = cc if cc < cd else cd
        least = least if least < other else other
        if least < self.cap:
            raised = least + 1
            if ca == least:
                counters[a] = raised
            if cb == least:
                counters[b] = raised
            if cc == least:
                counters[c] = raised
            if cd == least:
                counters[d] = raised
        self.increments += 1
        if self.increments >= self.period:
            self.counters = counters.translate(_HALVE)
            self.increments = 0
            self.resets += 1


def _pow2_at_least(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()
