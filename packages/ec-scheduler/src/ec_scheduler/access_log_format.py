"""The access log's file format: what the writer (`ec_scheduler.access_log`) writes
and the sizing tool (`ec_scheduler.sizing`) reads, defined once here.

Imports neither vLLM nor torch, so that `ec-cpu-sizing` runs anywhere.

Format (version 1), text, one record a line:

    # ec-access-log 1 block_bytes=<B> digest=blake2b-64-keyed started=<UTC time>
    # time_s digest rows bytes
    0.001234 3f9a0c1d22e4b7a8 576 1179648
    ...

* `time_s`: seconds since the log was opened (monotonic clock), 6 decimals;
* `digest`: 16 hex characters, BLAKE2b-64 of the item's tier key (with tenant
  isolation, the key carries its salt's digest: `ec_scheduler.tenancy`), keyed
  with 16 random bytes drawn when the log is opened and never written. The same
  key always has the same digest within one file; the key, the vLLM identifier
  and the salt cannot be recovered from it, nor can a known image be matched
  against it (no dictionary attack without the per-log key);
* `rows`: the item's embedding rows (its placeholder's embedding count);
* `bytes`: rows x the modality's encoder-output width x the model dtype's size
  (the width measured at start-up; the model's embedding width for a modality
  without one): the bytes its entry holds in the region before rounding up to
  whole blocks of `block_bytes` (one embedding row of the model).

A writer whose queue overflowed says so in a comment line, `# dropped <N> records`,
with the total so far (a reader keeps the largest). A reader ignores other lines
starting with `#` after the first, and a last line without its newline (cut short:
an engine that stopped mid-write), whatever it holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from dataclasses import dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
MAGIC = "# ec-access-log"
"""How the first line of a log starts (then the version and the header's fields)."""
DIGEST_BYTES = 8
"""Bytes of a record's digest (16 hex characters)."""


def header_lines(block_bytes: int, started: datetime.datetime) -> str:
    """The file's first two lines (`started`: when the log was opened, in UTC)."""
    return (
        f"{MAGIC} {FORMAT_VERSION} block_bytes={block_bytes} "
        f"digest=blake2b-{DIGEST_BYTES * 8}-keyed started={started:%Y-%m-%dT%H:%M:%SZ}\n"
        "# time_s digest rows bytes\n"
    )


def record_line(time_s: float, digest: str, rows: int, nbytes: int) -> str:
    """One record's line."""
    return f"{time_s:.6f} {digest} {rows} {nbytes}\n"


_DROPPED = "# dropped "


def dropped_line(total: int) -> str:
    """The comment line saying `total` records were dropped so far."""
    return f"{_DROPPED}{total} records\n"


@dataclass(frozen=True)
class AccessRecords:
    """An access log as read: one entry per record, in the file's order."""

    block_bytes: int
    """What one block of the engine's region held (the header's `block_bytes`)."""
    times: list[float] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    dropped: int = 0
    """Records the writer dropped (its queue full): the log lacks them."""
    cut_short: bool = False
    """Whether the last line lacked its newline and was ignored."""


def read_log(path: Path) -> AccessRecords:
    """Read an access log; ValueError naming the line when it is not one (or a newer
    version than this reader knows)."""
    with path.open("r", encoding="ascii", errors="replace") as file:
        header = file.readline()
        fields = header.split()
        if not header.startswith(MAGIC + " ") or len(fields) < 3:
            raise ValueError(f"{path}: line 1 is not an ec-access-log header")
        if fields[2] != str(FORMAT_VERSION):
            raise ValueError(
                f"{path}: access log version {fields[2]}; this reader knows {FORMAT_VERSION}"
            )
        options = dict(item.split("=", 1) for item in fields[3:] if "=" in item)
        try:
            block_bytes = int(options["block_bytes"])
        except (KeyError, ValueError):
            raise ValueError(f"{path}: the header names no block_bytes") from None
        records = AccessRecords(block_bytes)
        dropped = 0
        cut_short = False
        for number, line in enumerate(file, start=2):
            if not line.endswith("\n"):
                # The engine stopped mid-write: the line may parse (a number cut
                # short), but not as what was meant. It is the last one.
                cut_short = True
                break
            if line.startswith(_DROPPED):
                with contextlib.suppress(IndexError, ValueError):
                    dropped = max(dropped, int(line.split()[2]))
                continue
            if line.startswith("#") or not line.strip():
                continue
            parts = line.split()
            try:
                when, digest, rows, nbytes = float(parts[0]), parts[1], int(parts[2]), int(parts[3])
            except (IndexError, ValueError):
                raise ValueError(f"{path}: line {number} is not a record: {line!r}") from None
            records.times.append(when)
            records.digests.append(digest)
            records.rows.append(rows)
            records.nbytes.append(nbytes)
    return dataclasses.replace(records, dropped=dropped, cut_short=cut_short)
