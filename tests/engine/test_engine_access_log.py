"""The access log inside a real vLLM CPU engine, and the sizing tool on what it wrote."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from ec_scheduler.sizing import main, read_log
from ectools.engine import TEST_PASSES, connector_spec, region_files, run_in_subprocess

pytestmark = pytest.mark.engine

SALT = "tenant-log-5e1d"


def test_the_access_log_records_each_lookup_and_replays(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """Two passes over the ten images with a cache salt: one record per lookup the
    scheduler counted, one digest per image, each image 8 rows of 128 fp32 (4096
    bytes); no salt in the file; `ec-cpu-sizing` replays it."""
    log = tmp_path / "access.log"
    spec = connector_spec(
        model_dir,
        tmp_path,
        multiprocess=False,
        passes=[TEST_PASSES[0]] * 2,
        cache_salts=[SALT, SALT],
        extra={
            "ec_cpu_bytes": "4MiB",
            "ec_cpu_dir": str(tmp_path),
            "ec_access_log": str(log),
            "ec_access_log_max_bytes": "1MiB",
        },
    )
    result = run_in_subprocess(spec)
    assert result["passes"] == [baseline[0], baseline[1]]
    assert region_files(tmp_path) == []
    counters = result["counters"]
    records = read_log(log)
    assert records.block_bytes == 512
    assert len(records.digests) == counters["lookups"] >= 10
    per_image = collections.Counter(records.digests)
    assert len(per_image) == 10, "one digest per image"
    assert sum(count == 2 for count in per_image.values()) >= counters["hits"] >= 6
    assert set(records.rows) == {8} and set(records.nbytes) == {8 * 128 * 4}
    assert SALT.encode() not in log.read_bytes()
    assert main(["--log", str(log), "--sizes", "10%,50%,100%"]) == 0
