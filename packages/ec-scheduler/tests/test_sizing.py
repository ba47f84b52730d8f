"""The sizing tool (`ec_scheduler.sizing`, `ec-cpu-sizing`) and the replays it shares
with the hit-ratio benchmark (`ec_scheduler.sizing_references`)."""

from __future__ import annotations

import random
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from ec_scheduler.access_log import AccessLog
from ec_scheduler.sizing import (
    CACHES,
    DEFAULT_FRACTIONS,
    SizedTrace,
    default_capacities,
    main,
    nice_ceiling,
    parse_sizes,
    read_log,
    sweep,
    table,
    trace_of_log,
)
from ec_scheduler.sizing_references import (
    TierCache,
    run_belady,
    run_oracle,
    run_ours,
    run_plain_lru,
)

BLOCK = 1024
SVG = "{http://www.w3.org/2000/svg}"


@dataclass(frozen=True)
class _Trace:
    keys: list[str]
    sizes: dict[str, int]


def _trace(requests: int = 600, items: int = 80, seed: int = 5) -> SizedTrace:
    """A seeded Zipf-like trace of items of 1-40 blocks."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** 0.9 for rank in range(items)]
    keys = [f"item-{n}" for n in rng.choices(range(items), weights=weights, k=requests)]
    sizes = {key: rng.randint(1, 40) for key in dict.fromkeys(keys)}
    return SizedTrace("test", keys, sizes)


def _write(trace: SizedTrace, path: Path, *, extra_bytes: int = 0) -> AccessLog:
    """`trace` as an access log: each item's bytes fill its blocks (less `extra_bytes`)."""
    log = AccessLog(path, 1 << 24, block_bytes=BLOCK, buffer_records=len(trace.keys) + 1)
    for key in trace.keys:
        blocks = trace.sizes[key]
        log.record(key, blocks * 2, blocks * BLOCK - extra_bytes)
    log.close()
    assert log.dropped == 0
    return log


# ---------------------------------------------------------------- references


def test_the_references_on_a_trace_worked_by_hand() -> None:
    """Capacity 4 blocks; a=2, b=2, c=3 blocks; requests a b a c a b."""
    trace = _Trace(list("abacab"), {"a": 2, "b": 2, "c": 3})
    lru = run_plain_lru(trace, 4)  # a b [a hit] c(evicts b, a) a b
    assert (lru.hits, lru.requests, lru.hit_ratio) == (1, 6, 2 / 13)
    oracle = run_oracle(trace, 4)  # holds a (3 requests) and b (2): hits a, a, b
    assert (oracle.hits, oracle.hit_ratio) == (3, 6 / 13)
    belady = run_belady(trace, 4)  # never admits c (no future use): hits a, a, b
    assert (belady.hits, belady.hit_ratio) == (3, 6 / 13)
    ours = run_ours(trace, 4, "lru")
    assert ours.requests == 6 and ours.hits >= 1


def test_tier_cache_pins_and_releases_a_hit() -> None:
    cache = TierCache(8, "lru")
    assert cache.request("x") is False
    assert cache.save("x", 3) == [0, 1, 2]
    assert cache.request("x") is True
    entry = cache.alloc.get("x")
    assert entry is not None and entry.ready and entry.evictable
    assert cache.save("too-big", 9) is None


# ------------------------------------------------------------------ the log


def test_a_replayed_log_is_the_trace_it_recorded(tmp_path: Path) -> None:
    trace = _trace()
    log = _write(trace, tmp_path / "a.log")
    records = read_log(tmp_path / "a.log")
    assert records.block_bytes == BLOCK
    replayed = trace_of_log(records)
    assert replayed.keys == [log.digest(key) for key in trace.keys]
    assert replayed.sizes == {log.digest(key): blocks for key, blocks in trace.sizes.items()}
    renamed = SizedTrace("renamed", replayed.keys, replayed.sizes)
    capacities = default_capacities(trace)
    from_log, in_memory = sweep(replayed, capacities), sweep(renamed, capacities)
    assert from_log == in_memory
    original = sweep(trace, capacities)
    for got, want in zip(from_log, original, strict=True):
        for name in ("plain LRU", "oracle", "Belady"):  # blind to the keys' names
            assert got.results[name] == want.results[name]


def test_bytes_become_whole_blocks(tmp_path: Path) -> None:
    """An item's footprint is its bytes rounded up to blocks, of the log's size or the
    one given."""
    trace = _trace(requests=50, items=10)
    _write(trace, tmp_path / "a.log", extra_bytes=1)  # one byte short of whole blocks
    records = read_log(tmp_path / "a.log")
    assert sorted(trace_of_log(records).sizes.values()) == sorted(trace.sizes.values())
    doubled = trace_of_log(records, block_bytes=2 * BLOCK)
    assert sorted(doubled.sizes.values()) == sorted((b + 1) // 2 for b in trace.sizes.values())


def test_a_record_cut_short_ends_the_log_and_garbage_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    _write(_trace(requests=20), path)
    text = path.read_text()
    path.write_text(text + "12.5 00ff")  # the engine stopped mid-line
    assert len(read_log(path).digests) == 20 and read_log(path).cut_short
    path.write_text(text + "12.5 00ff00ff00ff00ff 576 11")  # cut inside its bytes: parses
    read = read_log(path)
    assert len(read.digests) == 20 and read.cut_short and 11 not in read.nbytes
    whole = tmp_path / "whole.log"
    _write(_trace(requests=3), whole)
    assert not read_log(whole).cut_short
    path.write_text(text + "12.5 00ff\n")
    with pytest.raises(ValueError, match="line 23 is not a record"):
        read_log(path)
    path.write_text("time digest rows bytes\n")
    with pytest.raises(ValueError, match="not an ec-access-log header"):
        read_log(path)
    path.write_text(text.replace("ec-access-log 1", "ec-access-log 9", 1))
    with pytest.raises(ValueError, match="version 9"):
        read_log(path)


# ------------------------------------------------------------ sizes, table


def test_the_table_shows_what_the_references_compute() -> None:
    trace = _trace()
    capacities = default_capacities(trace)
    working_set = sum(trace.sizes.values())
    assert capacities == [int(working_set * f) for f in DEFAULT_FRACTIONS]
    rows = sweep(trace, capacities, "s3lfu")
    for row, capacity in zip(rows, capacities, strict=True):
        assert row.capacity == capacity
        assert row.results["plain LRU"] == run_plain_lru(trace, capacity)
        assert row.results["oracle"] == run_oracle(trace, capacity)
        assert row.results["Belady"] == run_belady(trace, capacity)
        assert row.results["ours"] == run_ours(trace, capacity, "s3lfu")
    lines = table(rows, trace, BLOCK, "s3lfu")
    assert "policy s3lfu" in lines[1]
    body = lines[-len(rows) - 2 : -2]
    lru_line = lines[-2]
    assert lru_line.startswith("byte hit ratio of ours / plain LRU")
    want = [row.results["ours"].hit_ratio / row.results["plain LRU"].hit_ratio for row in rows]
    assert lru_line.split(": ")[1] == ", ".join(f"{ratio:.2f}x" for ratio in want)
    for line, row in zip(body, rows, strict=True):
        cells = line.split("|")
        ratios = [float(cell) for cell in cells[1].split()]
        saved = [int(cell) for cell in cells[2].split()]
        assert ratios == [round(row.results[name].hit_ratio, 3) for name in CACHES]
        assert saved == [row.results[name].hits for name in CACHES]


def test_sizes_are_bytes_or_shares_of_the_working_set() -> None:
    trace = _trace()
    working_set = sum(trace.sizes.values())
    assert parse_sizes("8KiB, 10%,1MB", trace, BLOCK) == [8, int(working_set * 0.1), 976]
    for bad in ("1KB", "10 apples", "-5%", "x%", "", "0"):
        with pytest.raises(ValueError, match="--sizes"):
            parse_sizes(bad, trace, BLOCK)


def test_axis_tops_are_round() -> None:
    assert [nice_ceiling(v) for v in (0.0, 0.73, 1.0, 1.01, 10336, 2600)] == [
        1.0,
        0.8,
        1.0,
        1.2,
        12000.0,
        3000.0,
    ]


# --------------------------------------------------------------------- CLI


def test_the_command_prints_the_table_and_writes_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(requests=300, items=40)
    _write(trace, tmp_path / "a.log")
    svg = tmp_path / "plot.svg"
    assert main(["--log", str(tmp_path / "a.log"), "--sizes", "5%,20KiB", "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "byte hit ratio" in out and "encoder runs saved" in out and "plot written" in out
    assert "20.00 KiB" in out
    root = ET.fromstring(svg.read_text())
    assert root.tag == f"{SVG}svg"
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 2 * len(CACHES), "each cache in each panel"
    assert all(len(line.get("points", "").split()) == 2 for line in lines), "two sizes"
    texts = "".join(text.text or "" for text in root.iter(f"{SVG}text"))
    assert "Byte hit ratio" in texts and "Encoder runs saved" in texts


def test_the_command_says_when_the_log_lacks_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "a.log"
    log = AccessLog(path, 1 << 20, block_bytes=BLOCK, buffer_records=50, interval_s=3600.0)
    for key in _trace(requests=80).keys:  # (the writer drains only when closed)
        log.record(key, 2, BLOCK)
    log.close()
    assert log.dropped == 30
    assert main(["--log", str(path), "--sizes", "20%"]) == 0
    assert "dropped 30 records" in capsys.readouterr().out
    _write(_trace(requests=80), path)
    assert main(["--log", str(path), "--sizes", "20%"]) == 0
    assert "dropped" not in capsys.readouterr().out


def test_the_command_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_log = tmp_path / "x.log"
    not_a_log.write_text("hello\n")
    for argv in (
        ["--log", str(not_a_log)],
        ["--log", str(tmp_path / "missing.log")],
        ["--log", str(not_a_log), "--policy", "fifo"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    assert "not an ec-access-log header" in capsys.readouterr().err
    empty = tmp_path / "empty.log"
    AccessLog(empty, 4096, block_bytes=BLOCK).close()
    with pytest.raises(SystemExit, match="2"):
        main(["--log", str(empty)])
    assert "no record" in capsys.readouterr().err
