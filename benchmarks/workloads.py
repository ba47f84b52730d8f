"""Seeded request traces of multimodal items, for the cache benchmarks.

A trace is a list of item keys in request order; each key has a size in
embedding rows (= region blocks: one block holds one row). Sizes are drawn
log-uniformly between 256 and 16 384 rows, independently of popularity.

* `zipf(alpha)`: 1 200 items, popularity ∝ 1 / rank^alpha.
* `zipf_scans`: the Zipf(1.0) stream, interrupted on average every ~60
  requests by a scan of 20-60 one-off items (a crawl of new images), so about
  30 % of requests are items never seen again.
* `chat`: multi-turn conversations; 40 are live at a time, each turn adds an
  image with probability 0.5 and re-sends the conversation's last three
  images; a conversation ends after a turn with probability 0.08.

Capacities are fractions (5 %, 10 %, 20 %) of the trace's working set: the
total size of its distinct items.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MIN_ROWS = 256
MAX_ROWS = 16384
LENGTH = 12_000
ITEMS = 1_200


@dataclass(frozen=True)
class Trace:
    name: str
    keys: list[str]
    sizes: dict[str, int]

    @property
    def working_set(self) -> int:
        return sum(self.sizes.values())

    @property
    def distinct(self) -> int:
        return len(self.sizes)


def _sizes(keys: list[str], seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    sizes: dict[str, int] = {}
    low, high = MIN_ROWS.bit_length() - 1, MAX_ROWS.bit_length() - 1
    for key in keys:
        if key not in sizes:
            sizes[key] = int(2 ** rng.uniform(low, high))
    return sizes


def _zipf_keys(alpha: float, length: int, items: int, rng: random.Random) -> list[str]:
    weights = [1.0 / (rank + 1) ** alpha for rank in range(items)]
    order = list(range(items))
    rng.shuffle(order)  # popularity rank is unrelated to key or size
    return [f"img{order[r]}" for r in rng.choices(range(items), weights=weights, k=length)]


def zipf(alpha: float, *, length: int = LENGTH, items: int = ITEMS, seed: int = 1) -> Trace:
    keys = _zipf_keys(alpha, length, items, random.Random(seed))
    return Trace(f"zipf a={alpha}", keys, _sizes(keys, seed + 100))


def zipf_scans(*, length: int = LENGTH, items: int = ITEMS, seed: int = 2) -> Trace:
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
    return Trace("zipf+scans", keys, _sizes(keys, seed + 100))


def chat(*, length: int = LENGTH, seed: int = 3, live: int = 40) -> Trace:
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
    return Trace("chat", keys, _sizes(keys, seed + 100))


def all_traces() -> list[Trace]:
    return [zipf(0.8), zipf(1.0), zipf(1.2), zipf_scans(), chat()]


CAPACITIES = (0.05, 0.10, 0.20)
