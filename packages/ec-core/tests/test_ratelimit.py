"""RateLimitedWarnings: one line per tag and period, held lines counted, bounded memory."""

from __future__ import annotations

import logging

import pytest

from ec_core import ratelimit
from ec_core.ratelimit import RateLimitedWarnings


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_tag_and_period_with_the_held_count(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.ratelimit")
    clock = _Clock()
    warnings = RateLimitedWarnings(logger, period_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        assert warnings.warn("a", "first %s", 1)
        assert not warnings.warn("a", "again %s", 2)
        assert not warnings.warn("a", "again %s", 3)
        assert warnings.warn("b", "other tag")  # tags are independent
        clock.now = 10.0
        assert warnings.warn("a", "later %s", 4)
    assert [r.getMessage() for r in caplog.records] == [
        "first 1",
        "other tag",
        "later 4 (and 2 more like it since the previous warning)",
    ]


def test_the_tags_remembered_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tags can come from client input (a handle's peer): memory must not grow with them."""
    monkeypatch.setattr(ratelimit, "MAX_TAGS", 8)
    clock = _Clock()
    warnings = RateLimitedWarnings(logging.getLogger("test.ratelimit"), clock=clock)
    for i in range(100):
        assert warnings.warn(f"peer-{i}", "down")
        assert not warnings.warn(f"peer-{i}", "down")  # held: counted for that tag
    assert len(warnings._last) == 8 and len(warnings._held) <= 8
    assert set(warnings._last) == {f"peer-{i}" for i in range(92, 100)}, "the newest are kept"
    # A remembered tag is still limited; a forgotten one may log again.
    assert not warnings.warn("peer-99", "down")
    assert warnings.warn("peer-0", "down")
