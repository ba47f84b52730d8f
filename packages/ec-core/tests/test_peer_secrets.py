"""A running engine's secrets follow `ec_peer_secret_file`: the roll A -> B in place."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from ec_core import peer_secrets
from ec_core.peer_secrets import RELOAD_CHECK_S, PeerSecrets

A, B = "secret-A-0123456789", "secret-B-0123456789"


def _write(path: Path, text: str, mode: int = 0o600) -> None:
    """Replace the file at once, as a mounted secret is (a reader never sees half)."""
    staged = path.with_name(path.name + ".new")
    staged.write_text(text)
    os.chmod(staged, mode)
    os.replace(staged, path)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_secrets_without_a_file_never_change() -> None:
    keys = PeerSecrets((A, B))
    assert keys.signing == A.encode() and keys.accepted == (A.encode(), B.encode())
    with pytest.raises(ValueError, match="at least one secret"):
        PeerSecrets(())


def test_a_rewritten_file_is_taken_within_a_check_period(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    _write(path, f"{A}\n")
    clock = _Clock()
    keys = PeerSecrets((A,), str(path), clock=clock)
    phases = [[A, B], [B, A], [B]]
    for phase in phases:
        _write(path, "\n".join(phase) + "\n")
        clock.now += RELOAD_CHECK_S / 2
        assert keys.signing == A.encode() or keys.accepted != tuple(s.encode() for s in phase), (
            "not looked at before the period is over"
        )
        clock.now += RELOAD_CHECK_S
        assert keys.accepted == tuple(s.encode() for s in phase)
        assert keys.signing == phase[0].encode()
    assert keys.reloads == 3


def test_a_file_is_looked_at_at_most_once_a_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "secret"
    _write(path, f"{A}\n")
    clock = _Clock()
    keys = PeerSecrets((A,), str(path), clock=clock)
    stats: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(
        os, "stat", lambda p, *a, **k: stats.append(str(p)) or real_stat(p, *a, **k)
    )
    for _ in range(1000):
        keys.accepted  # noqa: B018 (the hot path: no stat within the period)
    assert stats == []
    clock.now += RELOAD_CHECK_S
    for _ in range(1000):
        keys.signing  # noqa: B018
    assert stats == [str(path)]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ("mode", "mode 0644"),
        ("short", "shorter than 8"),
        ("empty", "holds no secret"),
        ("twice", "listed twice"),
        ("gone", "cannot be opened"),
    ],
)
def test_a_bad_new_file_keeps_the_old_secrets_and_warns_once_a_minute(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: str, needle: str
) -> None:
    path = tmp_path / "secret"
    _write(path, f"{A}\n{B}\n")
    clock = _Clock()
    keys = PeerSecrets((A, B), str(path), clock=clock)
    if change == "mode":
        _write(path, f"{B}\n", 0o644)
    elif change == "short":
        _write(path, f"{B}\nshort\n")
    elif change == "empty":
        _write(path, "\n")
    elif change == "twice":
        _write(path, f"{B}\n{B}\n")
    else:
        path.unlink()
    caplog.set_level(logging.WARNING)
    for _ in range(5):
        clock.now += RELOAD_CHECK_S
        assert keys.accepted == (A.encode(), B.encode()), "the old secrets stay"
        if change != "gone":
            os.utime(path, ns=(int(clock.now * 1e9), int(clock.now * 1e9)))  # looks new each time
    warned = [r.getMessage() for r in caplog.records if "keeping the previous" in r.getMessage()]
    assert len(warned) == 1 and needle in warned[0]
    assert A not in warned[0] and B not in warned[0]
    # Fixed: taken at the next look.
    _write(path, f"{B}\n")
    clock.now += RELOAD_CHECK_S
    assert keys.accepted == (B.encode(),)


def test_threads_see_the_old_tuple_or_the_new_never_a_mix(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    _write(path, f"{A}\n{B}\n")
    clock = _Clock()
    keys = PeerSecrets((A, B), str(path), clock=clock)
    seen: set[tuple[bytes, ...]] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.add(keys.accepted)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for thread in readers:
        thread.start()
    for text in (f"{B}\n{A}\n", f"{B}\n") * 20:
        _write(path, text)
        clock.now += RELOAD_CHECK_S
        keys.accepted  # noqa: B018
    stop.set()
    for thread in readers:
        thread.join()
    allowed = {(A.encode(), B.encode()), (B.encode(), A.encode()), (B.encode(),)}
    assert seen <= allowed and seen


def test_the_file_is_read_through_a_link_swapped_as_kubernetes_does(tmp_path: Path) -> None:
    """A mounted secret is `key -> ..data/key`, `..data` a link swapped to a new directory."""
    for name, text in (("v1", f"{A}\n"), ("v2", f"{B}\n{A}\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "key").write_text(text)
        os.chmod(tmp_path / name / "key", 0o400)
    (tmp_path / "..data").symlink_to("v1")
    (tmp_path / "key").symlink_to("..data/key")
    path = str(tmp_path / "key")
    assert peer_secrets.read_secret_file(path) == (A,)
    clock = _Clock()
    keys = PeerSecrets((A,), path, clock=clock)
    (tmp_path / "..data_tmp").symlink_to("v2")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    clock.now += RELOAD_CHECK_S
    assert keys.accepted == (B.encode(), A.encode())
