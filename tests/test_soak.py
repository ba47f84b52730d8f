"""The randomised soak at test size (the full 10^5 steps: `hatch run soak`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ectools.soak import run_soak


@pytest.mark.slow
def test_soak_four_workers_one_region(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = 3_000
    result = run_soak(steps, seed=7, workdir=str(tmp_path), kill_rank_at=steps // 2)
    with capsys.disabled():
        print(f"\n[soak] {vars(result)}")
    assert result.loads_checked > 5_000, "the soak must exercise loads"
    # (The default policy, on this Zipf traffic, keeps its hot items: some 500 saves and
    # evictions in 3 000 steps.)
    assert result.saves > 300 and result.evictions > 300
    assert result.split_copies > 0, "entries lying in several runs must be copied too"
    assert result.reports_lost > 0 and result.reports_late > 0 and result.ranks_killed == 1
    assert result.copies_past_bound > 0, "some copies must land later than the report bound"
    assert result.overdue > 0, "and the scheduler must have found them overdue"
    assert result.settled_without_report > 0, "lost reports must settle by progress"
    assert result.stale_dropped > 0, "reused keys with new content must be dropped"
    assert result.corrupted_loads == 0
    assert result.entries_verified_at_rest > 0 and result.corrupted_at_rest == 0
    assert result.leaked_blocks == 0
    assert result.held_at_end == 0, "nothing may stay pinned or in flight after the bound"
