"""Seeded request traces of multimodal items, for the cache benchmarks.

A trace is a list of item keys in request order; each key has a size in
embedding rows (= region blocks: one block holds one row). Sizes are drawn
log-uniformly between 256 and 16 384 rows, independently of popularity
(`LOG_UNIFORM`, what Table 1 uses). Every generator takes `length` (requests)
and `size_dist`, one of `SIZE_DISTS` (the sweep in `sweep.py` uses the others;
a row is taken as `ROW_BYTES` = 4 KiB there, so 1 row is 4 KiB and 65 536 rows
256 MiB):

* `loguniform` (`LOG_UNIFORM`): 256-16 384 rows, log-uniform (1-64 MiB);
* `constant`: every item 1 024 rows (4 MiB);
* `heavy`: heavy-tailed, Pareto with shape 0.7 from 1 row, capped at
  65 536 rows: half the items are at most 2-3 rows (a few KB), one in a
  thousand is over 19 000 rows (75 MiB), the largest reach 256 MiB, and a
  few items hold much of the working set's bytes;
* `bimodal`: images and video: 80 % images of 256-1 024 rows (1-4 MiB),
  20 % videos of 8 192-32 768 rows (32-128 MiB), each log-uniform.

With the default `size_dist` every trace is the same, draw for draw, as
before the parameter existed (Table 1's numbers do not move).

* `zipf(alpha)`: 1 200 items, popularity ∝ 1 / rank^alpha.
* `zipf_scans`: the Zipf(1.0) stream, interrupted on average every ~60
  requests by a scan of 20-60 one-off items (a crawl of new images), so about
  30 % of requests are items never seen again.
* `chat`: multi-turn conversations; 40 are live at a time, each turn adds an
  image with probability 0.5 and re-sends the conversation's last three
  images; a conversation ends after a turn with probability 0.08.

Shorter traces (`SHORT` requests) of five more families, each aimed at one
way a policy can lose:

* `sessions`: multi-turn image chat with many sessions live at once: 150
  live, each turn re-sends the session's last four images (a sliding window)
  and adds one with probability 0.6; sessions are picked with a Zipf(0.6)
  skew over their start order (some users type faster) and end after a turn
  with probability 0.06. Pure recency: an image's past count says little.
* `bursts`: a popular-image pool (Zipf(0.9) over 400 images, 60 % of
  requests) plus bursts: a burst picks an image (new with probability 0.7)
  and asks for it 10-40 times over the next 150-400 requests; up to 8 bursts
  run at once. The rest are one-off images.
* `video`: 120 videos of 8-48 frames (a frame's size is its video's, 256-4096
  rows); a request asks for a clip of 4-16 consecutive frames of a
  Zipf(1.0)-popular video, frames shared by every clip that covers them.
* `loop`: a loop over 60 items (whose total is 11 % of the working set) in a
  fixed order, one request in three; the rest one-off images. At 10 %
  capacity the loop is slightly larger than the cache: LRU hits nothing in
  it, a frequency policy keeps most of it.
* `phase`: the first half is Zipf(1.0) over 600 images; the second half
  switches to a disjoint hot set (Zipf(1.0) over 600 new images, half the
  requests) mixed with `sessions`-style recency traffic (the other half).

Capacities are fractions (5 %, 10 %, 20 %) of the trace's working set: the
total size of its distinct items.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ec_scheduler.sizing import SizedTrace

MIN_ROWS = 256
MAX_ROWS = 16384
LENGTH = 12_000
SHORT = 4_000
ITEMS = 1_200
ROW_BYTES = 4096
"""The row size the size distributions are described in (1 row = 1 block = 4 KiB)."""


@dataclass(frozen=True)
class SizeDist:
    """A distribution of item sizes in rows: `draw` takes one size (>= 1) from `rng`."""

    name: str
    draw: Callable[[random.Random], int]


def _log_uniform(low: int, high: int) -> Callable[[random.Random], int]:
    """Sizes 2**U(log2 low, log2 high), truncated to ints; `low` and `high` powers of 2."""
    low_bits, high_bits = low.bit_length() - 1, high.bit_length() - 1
    return lambda rng: int(2 ** rng.uniform(low_bits, high_bits))


def _pareto(shape: float, cap: int) -> Callable[[random.Random], int]:
    return lambda rng: min(int(rng.paretovariate(shape)), cap)


def _bimodal(rng: random.Random) -> int:
    if rng.random() < 0.8:
        return int(2 ** rng.uniform(8, 10))  # an image: 256-1 024 rows
    return int(2 ** rng.uniform(13, 15))  # a video: 8 192-32 768 rows


LOG_UNIFORM = SizeDist("loguniform", _log_uniform(MIN_ROWS, MAX_ROWS))
SIZE_DISTS = {
    dist.name: dist
    for dist in (
        LOG_UNIFORM,
        SizeDist("constant", lambda rng: 1024),
        SizeDist("heavy", _pareto(0.7, 65536)),
        SizeDist("bimodal", _bimodal),
    )
}
"""The size distributions by name; `loguniform` is every generator's default."""


Trace = SizedTrace
"""A trace: its name, keys in request order, each key's size in rows (= blocks); the
sizing tool's trace type, so that it replays these as they are."""


def draw_sizes(keys: list[str], seed: int, size_dist: SizeDist = LOG_UNIFORM) -> dict[str, int]:
    """Each distinct key's size, drawn in order of first request from a `seed`ed stream."""
    rng = random.Random(seed)
    sizes: dict[str, int] = {}
    draw = size_dist.draw
    for key in keys:
        if key not in sizes:
            sizes[key] = draw(rng)
    return sizes


def _zipf_keys(alpha: float, length: int, items: int, rng: random.Random) -> list[str]:
    weights = [1.0 / (rank + 1) ** alpha for rank in range(items)]
    order = list(range(items))
    rng.shuffle(order)  # popularity rank is unrelated to key or size
    return [f"img{order[r]}" for r in rng.choices(range(items), weights=weights, k=length)]


def zipf(
    alpha: float,
    *,
    length: int = LENGTH,
    items: int = ITEMS,
    seed: int = 1,
    size_dist: SizeDist = LOG_UNIFORM,
) -> Trace:
    keys = _zipf_keys(alpha, length, items, random.Random(seed))
    return Trace(f"zipf a={alpha}", keys, draw_sizes(keys, seed + 100, size_dist))


def zipf_scans(
    *, length: int = LENGTH, items: int = ITEMS, seed: int = 2, size_dist: SizeDist = LOG_UNIFORM
) -> Trace:
    rng = random.Random(seed)
    base = _zipf_keys(1.0, length, items, rng)
    keys: list[str] = []
    scans = 0
    position = 0
    while len(keys) < length:
        if rng.random() < 1 / 60:
            keys.extend(f"scan{scans + i}" for i in range(rng.randint(20, 60)))
            scans += 60
        else:
            keys.append(base[position % len(base)])
            position += 1
    keys = keys[:length]
    return Trace("zipf+scans", keys, draw_sizes(keys, seed + 100, size_dist))


def chat(
    *, length: int = LENGTH, seed: int = 3, live: int = 40, size_dist: SizeDist = LOG_UNIFORM
) -> Trace:
    rng = random.Random(seed)
    keys: list[str] = []
    conversations: dict[int, list[str]] = {}
    active: list[int] = []
    started = images = 0
    while len(keys) < length:
        while len(active) < live:
            conversations[started] = []
            active.append(started)
            started += 1
        conversation = rng.choice(active)
        shown = conversations[conversation]
        if not shown or rng.random() < 0.5:
            shown.append(f"chat{images}")
            images += 1
        keys.extend(shown[-3:])
        if rng.random() < 0.08:
            active.remove(conversation)
    keys = keys[:length]
    return Trace("chat", keys, draw_sizes(keys, seed + 100, size_dist))


def _sessions_stream(
    rng: random.Random, prefix: str, *, live: int, window: int, new_image: float, end: float
) -> Iterator[list[str]]:
    """Turns (lists of keys) of many concurrent sliding-window chat sessions."""
    sessions: list[list[str]] = []
    started = images = 0
    skew = [1.0 / (rank + 1) ** 0.6 for rank in range(live)]
    while True:
        while len(sessions) < live:
            sessions.append([])
            started += 1
        index = rng.choices(range(live), weights=skew)[0]
        shown = sessions[index]
        if not shown or rng.random() < new_image:
            shown.append(f"{prefix}{images}")
            images += 1
        yield shown[-window:]
        if rng.random() < end:
            del sessions[index]  # the newest sessions take the slowest ranks


def sessions(
    *, length: int = SHORT, seed: int = 4, live: int = 150, size_dist: SizeDist = LOG_UNIFORM
) -> Trace:
    rng = random.Random(seed)
    keys: list[str] = []
    turns = _sessions_stream(rng, "s", live=live, window=4, new_image=0.6, end=0.06)
    while len(keys) < length:
        keys.extend(next(turns))
    keys = keys[:length]
    return Trace("sessions", keys, draw_sizes(keys, seed + 100, size_dist))


def bursts(*, length: int = SHORT, seed: int = 5, size_dist: SizeDist = LOG_UNIFORM) -> Trace:
    rng = random.Random(seed)
    pool = _zipf_keys(0.9, length, 400, rng)
    pending: list[tuple[int, str]] = []  # (position, key) of burst requests to come
    keys: list[str] = []
    slots: dict[int, str] = {}
    news = one_offs = 0
    for position in range(length):
        if len(pending) < 8 * 25 and rng.random() < 1 / 60:
            if rng.random() < 0.7:
                key = f"burst{news}"
                news += 1
            else:
                key = rng.choice(pool)
            span = rng.randint(150, 400)
            pending.extend(
                (position + rng.randrange(span), key) for _ in range(rng.randint(10, 40))
            )
            pending.sort()
        while pending and pending[0][0] <= position:
            slots.setdefault(position, pending.pop(0)[1])
        if position in slots:
            keys.append(slots.pop(position))
        elif rng.random() < 0.6 / 0.85:
            keys.append(pool[position])
        else:
            keys.append(f"once{one_offs}")
            one_offs += 1
    return Trace("bursts", keys, draw_sizes(keys, seed + 100, size_dist))


def video(
    *, length: int = SHORT, seed: int = 6, videos: int = 120, size_dist: SizeDist | None = None
) -> Trace:
    """Frames share their video's size: by default 256-4 096 rows, log-uniform; with
    `size_dist`, drawn from it per video."""
    rng = random.Random(seed)
    frames = [rng.randint(8, 48) for _ in range(videos)]
    draw = size_dist.draw if size_dist is not None else _log_uniform(MIN_ROWS, MAX_ROWS // 4)
    rows = [draw(rng) for _ in range(videos)]
    weights = [1.0 / (rank + 1) for rank in range(videos)]
    keys: list[str] = []
    while len(keys) < length:
        v = rng.choices(range(videos), weights=weights)[0]
        clip = rng.randint(4, 16)
        first = rng.randrange(max(frames[v] - clip, 0) + 1)
        keys.extend(f"v{v}f{f}" for f in range(first, min(first + clip, frames[v])))
    keys = keys[:length]
    sizes = {key: rows[int(key[1 : key.index("f")])] for key in keys}
    return Trace("video", keys, sizes)


def loop(
    *, length: int = SHORT, seed: int = 7, items: int = 60, size_dist: SizeDist = LOG_UNIFORM
) -> Trace:
    rng = random.Random(seed)
    keys: list[str] = []
    position = one_offs = 0
    while len(keys) < length:
        if rng.random() < 1 / 3:
            keys.append(f"loop{position % items}")
            position += 1
        else:
            keys.append(f"once{one_offs}")
            one_offs += 1
    sizes = draw_sizes(keys, seed + 100, size_dist)
    # Scale the one-offs so that the loop is 11 % of the working set.
    loop_rows = sum(size for key, size in sizes.items() if key.startswith("loop"))
    other_rows = sum(size for key, size in sizes.items() if not key.startswith("loop"))
    scale = loop_rows * (1 / 0.11 - 1) / other_rows
    for key in sizes:
        if not key.startswith("loop"):
            sizes[key] = max(int(sizes[key] * scale), 1)
    return Trace("loop", keys, sizes)


def phase(*, length: int = SHORT, seed: int = 8, size_dist: SizeDist = LOG_UNIFORM) -> Trace:
    rng = random.Random(seed)
    half = length // 2
    keys = _zipf_keys(1.0, half, 600, rng)
    hot = [f"b{key}" for key in _zipf_keys(1.0, length - half, 600, rng)]
    turns = _sessions_stream(rng, "p", live=60, window=3, new_image=0.5, end=0.08)
    turn: list[str] = []
    for key in hot:
        if len(keys) >= length:
            break
        if rng.random() < 0.5:
            keys.append(key)
        else:
            if not turn:
                turn = list(next(turns))
            keys.append(turn.pop(0))
    keys = keys[:length]
    return Trace("phase", keys, draw_sizes(keys, seed + 100, size_dist))


def all_traces() -> list[Trace]:
    return [
        zipf(0.8),
        zipf(1.0),
        zipf(1.2),
        zipf_scans(),
        chat(),
        sessions(),
        bursts(),
        video(),
        loop(),
        phase(),
    ]


CAPACITIES = (0.05, 0.10, 0.20)
