"""Sizes and settings: every accepted form, every malformed value."""

from __future__ import annotations

import errno
import logging
import math
import os
from pathlib import Path
from typing import Any

import pytest

from ec_core.settings import DEFAULT_REGION_DIR, ECCPUSettings
from ec_core.sizes import SizeError, format_bytes, parse_byte_size

BLOCK = 512


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        (8e9, 8_000_000_000),
        ("8e9", 8_000_000_000),
        ("123456", 123_456),
        ("512MiB", 512 * 1024**2),
        ("8GiB", 8 * 1024**3),
        ("8GB", 8 * 1000**3),
        ("8 gb", 8 * 1000**3),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("2KiB", 2048),
        ("3kb", 3000),
        ("1TiB", 1024**4),
        ("1TB", 1000**4),
        ("  64 MiB ", 64 * 1024**2),
        ("100B", 100),
    ],
)
def test_parse_byte_size_accepts(value: object, expected: int) -> None:
    assert parse_byte_size(value) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (True, "boolean"),
        (False, "boolean"),
        (0, "positive"),
        (-5, "positive"),
        ("-1GiB", "positive"),
        (0.0, "positive"),
        (math.nan, "finite"),
        (math.inf, "finite"),
        (-math.inf, "finite"),
        (1.5, "whole number"),
        ("0.5", "whole number"),
        ("nan", "expected a number"),
        ("inf", "expected a number"),
        ("lots", "expected a number"),
        ("", "expected a number"),
        ("8G", "ambiguous"),
        ("8m", "ambiguous"),
        ("8 parsecs", "unknown unit"),
        ("1e3.5", "expected a number"),
        (None, "got NoneType"),
        ([1], "got list"),
    ],
)
def test_parse_byte_size_rejects(value: object, reason: str) -> None:
    with pytest.raises(SizeError, match=reason):
        parse_byte_size(value)


def test_format_bytes() -> None:
    assert format_bytes(100) == "100 B"
    assert format_bytes(3 * 1024**3 // 2) == "1.50 GiB"


def test_settings_defaults(tmp_path: Path) -> None:
    settings = ECCPUSettings.from_extra_config({"ec_cpu_bytes": "1MiB"}, block_size_bytes=BLOCK)
    assert settings.cpu_bytes == 1024**2
    assert settings.region_dir == DEFAULT_REGION_DIR
    assert settings.open_timeout_s > 0


def test_settings_custom_dir_and_timeout(tmp_path: Path) -> None:
    settings = ECCPUSettings.from_extra_config(
        {"ec_cpu_bytes": 4096, "ec_cpu_dir": str(tmp_path), "ec_region_open_timeout_s": "2.5"},
        block_size_bytes=BLOCK,
    )
    assert settings.region_dir == tmp_path
    assert settings.open_timeout_s == 2.5


def test_relative_dir_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "regions").mkdir()
    monkeypatch.chdir(tmp_path)
    settings = ECCPUSettings.from_extra_config(
        {"ec_cpu_bytes": 4096, "ec_cpu_dir": "regions"}, block_size_bytes=BLOCK
    )
    assert settings.region_dir == tmp_path / "regions"
    assert settings.region_dir.is_absolute()


def test_missing_ec_cpu_bytes_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"\['ec_cpu_bytes'\] is required"):
        ECCPUSettings.from_extra_config({}, block_size_bytes=BLOCK)
    with pytest.raises(ValueError, match=r"\['ec_cpu_bytes'\] is required"):
        ECCPUSettings.from_extra_config(None, block_size_bytes=BLOCK)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (0, "positive"),
        (-1, "positive"),
        (math.nan, "finite"),
        (math.inf, "finite"),
        (True, "boolean"),
        ("garbage", "expected a number"),
        ("8G", "ambiguous"),
        (None, "got NoneType"),
        (BLOCK - 1, "smaller than one block"),
        ("100B", "smaller than one block"),
    ],
)
def test_malformed_ec_cpu_bytes_names_key_and_value(value: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as info:
        ECCPUSettings.from_extra_config({"ec_cpu_bytes": value}, block_size_bytes=BLOCK)
    message = str(info.value)
    assert "['ec_cpu_bytes']" in message
    assert repr(value) in message


def test_exactly_one_block_is_enough() -> None:
    settings = ECCPUSettings.from_extra_config({"ec_cpu_bytes": BLOCK}, block_size_bytes=BLOCK)
    assert settings.cpu_bytes == BLOCK


@pytest.mark.parametrize("value", [True, 17, "", "   "])
def test_malformed_dir_type(value: object) -> None:
    with pytest.raises(ValueError, match=r"\['ec_cpu_dir'\]") as info:
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_cpu_dir": value}, block_size_bytes=BLOCK
        )
    assert repr(value) in str(info.value)


def test_missing_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="not an existing directory"):
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_cpu_dir": str(missing)}, block_size_bytes=BLOCK
        )


def test_dir_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ValueError, match="not an existing directory"):
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_cpu_dir": str(file)}, block_size_bytes=BLOCK
        )


def test_a_dir_that_cannot_be_looked_at_is_a_value_error_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A component longer than NAME_MAX: stat fails with ENAMETOOLONG, which
    # Path.is_dir() raises instead of answering False.
    too_long = tmp_path / ("d" * 300)
    with pytest.raises(ValueError, match=r"\['ec_cpu_dir'\].*cannot look at"):
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_cpu_dir": str(too_long)}, block_size_bytes=BLOCK
        )
    # A parent this user may not search (EACCES; root is never refused, so injected).
    private = tmp_path / "private"
    real_stat = os.stat

    def refusing_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if os.fspath(path).startswith(os.fspath(private)):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", refusing_stat)
    with pytest.raises(ValueError, match=r"\['ec_cpu_dir'\].*Permission denied"):
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_cpu_dir": str(private / "shm")}, block_size_bytes=BLOCK
        )


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_dir(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="not readable and writable"):
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_cpu_dir": str(locked)}, block_size_bytes=BLOCK
        )


def test_a_dir_this_user_cannot_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A write-only directory (mode 0300): workers open it to lock it and list it for
    # stale files, so it must fail here, naming the key, not later in a worker. Root
    # may read anything, so the refusal is injected.
    real_access = os.access

    def no_read(path: Any, mode: int, *args: Any, **kwargs: Any) -> bool:
        return not mode & os.R_OK and real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", no_read)
    with pytest.raises(ValueError, match=r"\['ec_cpu_dir'\].*not readable and writable"):
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_cpu_dir": str(tmp_path)}, block_size_bytes=BLOCK
        )


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, True, "soon", None])
def test_malformed_open_timeout(value: object) -> None:
    with pytest.raises(ValueError, match=r"\['ec_region_open_timeout_s'\]"):
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_region_open_timeout_s": value}, block_size_bytes=BLOCK
        )


def test_unknown_keys_warn_once_naming_them(ec_log: pytest.LogCaptureFixture) -> None:
    ECCPUSettings.from_extra_config(
        {"ec_cpu_bytes": 4096, "ec_cpu_byts": 1, "zzz": 2, "ec_enable_nixl": False},
        block_size_bytes=BLOCK,
    )
    warnings = [r for r in ec_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "ec_cpu_byts" in message
    assert "zzz" in message
    assert "ec_enable_nixl" not in message


def test_known_keys_do_not_warn(ec_log: pytest.LogCaptureFixture) -> None:
    ECCPUSettings.from_extra_config({"ec_cpu_bytes": 4096}, block_size_bytes=BLOCK)
    assert not [r for r in ec_log.records if r.levelno >= logging.WARNING]


def test_report_bounds_and_policy() -> None:
    settings = ECCPUSettings.from_extra_config(
        {
            "ec_cpu_bytes": 4096,
            "ec_report_timeout_steps": "10",
            "ec_report_timeout_s": 0,
            "ec_eviction_policy": " LRU ",
        },
        block_size_bytes=BLOCK,
    )
    assert settings.report_timeout_steps == 10
    assert settings.report_timeout_s == 0
    assert settings.policy == "lru"
    defaults = ECCPUSettings.from_extra_config({"ec_cpu_bytes": 4096}, block_size_bytes=BLOCK)
    assert defaults.report_timeout_steps > 0 and defaults.report_timeout_s > 0


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("ec_report_timeout_steps", -1, "whole number >= 0"),
        ("ec_report_timeout_steps", 2.5, "whole number >= 0"),
        ("ec_report_timeout_steps", True, "whole number"),
        ("ec_report_timeout_steps", "many", "whole number >= 0"),
        ("ec_report_timeout_s", -1, "non-negative"),
        ("ec_report_timeout_s", math.nan, "non-negative"),
        ("ec_report_timeout_s", "later", "number of seconds"),
        ("ec_eviction_policy", "random", "expected one of"),
        ("ec_eviction_policy", 3, "expected one of"),
    ],
)
def test_malformed_bounds_and_policy(key: str, value: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as info:
        ECCPUSettings.from_extra_config({"ec_cpu_bytes": 4096, key: value}, block_size_bytes=BLOCK)
    assert f"['{key}']" in str(info.value)


def test_both_report_bounds_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot both be 0"):
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_report_timeout_steps": 0, "ec_report_timeout_s": 0},
            block_size_bytes=BLOCK,
        )


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"ec_cpu_bytes": "1e999999999"}, "ec_cpu_bytes"),
        ({"ec_cpu_bytes": "1e400"}, "ec_cpu_bytes"),
        ({"ec_cpu_bytes": 10**400}, "ec_cpu_bytes"),
        ({"ec_cpu_bytes": "1e1000000GiB"}, "ec_cpu_bytes"),
        ({"ec_cpu_bytes": 4096, "ec_region_open_timeout_s": 10**400}, "ec_region_open_timeout_s"),
        ({"ec_cpu_bytes": 4096, "ec_report_timeout_s": 10**400}, "ec_report_timeout_s"),
        (
            {
                "ec_cpu_bytes": 4096,
                "ec_peers": ["h:1"],
                "ec_peer_fetch_timeout_s": 10**400,
            },
            "ec_peer_fetch_timeout_s",
        ),
    ],
)
def test_an_out_of_range_number_is_the_settings_value_error(
    extra: dict[str, object], key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Too large to compute with is malformed too: the parser's own ValueError naming
    the key (which the early check passes on), never decimal.Overflow or OverflowError
    (which it leaves for the engine, to fail cryptically in a worker)."""
    monkeypatch.setenv("EC_CPU_TIER_PEER_SECRET", "s3cret-for-tests")
    with pytest.raises(ValueError, match=rf"\['{key}'\]"):
        ECCPUSettings.from_extra_config(extra, block_size_bytes=BLOCK, role="ec_both")


def test_a_size_beyond_any_file_is_refused_where_the_config_is_built() -> None:
    """Accepted, a size past float range made the worker's own "too large for the
    directory" check fail with OverflowError (format_bytes) instead of its ValueError."""
    with pytest.raises(SizeError, match="too large"):
        parse_byte_size("1e400")
    assert parse_byte_size("4TiB") == 4 * 1024**4


def test_a_home_directory_that_cannot_be_expanded_names_the_key() -> None:
    """`~user` naming no user made `Path.expanduser` raise RuntimeError: the early check
    left it to the engine, which then failed without naming the key."""
    with pytest.raises(ValueError, match=r"\['ec_cpu_dir'\] = '~no-such-user-ec-cpu/shm'"):
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_cpu_dir": "~no-such-user-ec-cpu/shm"},
            block_size_bytes=BLOCK,
        )


@pytest.mark.parametrize("value", ["²", "1" * 5000])
def test_digits_int_cannot_read_are_a_count_error_naming_the_key(value: str) -> None:
    """`str.isdigit` admits superscripts and strings past Python's int-conversion
    limit; `int()` then raised its own ValueError, which named no key."""
    with pytest.raises(ValueError, match=r"\['ec_report_timeout_steps'\].*whole number"):
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_report_timeout_steps": value}, block_size_bytes=BLOCK
        )
