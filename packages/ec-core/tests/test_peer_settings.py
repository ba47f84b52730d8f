"""The cross-engine keys: parsed, checked against the role, secrets never shown."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ec_core.peer_settings import SECRET_ENV, PeerAddress, parse_peer_settings
from ec_core.settings import ECCPUSettings

SECRET = "s3cret-for-tests"


def _private(path: Path, data: bytes, mode: int = 0o600) -> str:
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def test_no_peer_key_means_the_layer_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert parse_peer_settings({}, "ec_both") is None
    settings = ECCPUSettings.from_extra_config({"ec_cpu_bytes": 4096}, block_size_bytes=512)
    assert settings.peers is None


def test_a_producer_and_a_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    both = parse_peer_settings(
        {
            "ec_peer_listen": "127.0.0.1:5710",
            "ec_peers": ["10.0.0.2:5710", "[::1]:6000", "node-3.local:5711"],
            "ec_peer_lookup_timeout_s": "0.5",
        },
        "ec_both",
    )
    assert both is not None
    assert both.listen == PeerAddress("127.0.0.1", 5710)
    assert [str(p) for p in both.peers] == ["10.0.0.2:5710", "[::1]:6000", "node-3.local:5711"]
    assert both.lookup_timeout_s == 0.5 and both.fetch_timeout_s == 10 and both.lease_s == 30
    assert SECRET not in repr(both)


def test_the_secret_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    peers = parse_peer_settings({"ec_peers": ["127.0.0.1:1"]}, "ec_consumer")
    assert peers is not None and peers.secret == SECRET
    # A secret alone turns the layer on: request-level handles can then be used.
    alone = parse_peer_settings({}, "ec_consumer")
    assert alone is not None and alone.peers == () and alone.listen is None


@pytest.mark.parametrize(
    ("extra", "role", "needle"),
    [
        ({"ec_peer_listen": "nohost"}, "ec_both", "HOST:PORT"),
        ({"ec_peer_listen": "h:70000"}, "ec_both", "between 1 and"),
        ({"ec_peer_listen": "h:1"}, "ec_consumer", "only ec_producer"),
        ({"ec_peers": ["h:1"]}, "ec_producer", "only ec_consumer"),
        ({"ec_peers": "h:1"}, "ec_both", "a list of"),
        ({"ec_peers": ["h:1", "h:1"]}, "ec_both", "listed twice"),
        (
            {"ec_peers": ["h:1"], "ec_peer_lease_s": 5},
            "ec_both",
            "must exceed ec_peer_fetch_timeout_s",
        ),
        (
            {"ec_peers": ["h:1"], "ec_peer_lease_s": 11},
            "ec_both",
            "by more than 1 s",
        ),
        (
            {"ec_peers": ["h:1"], "ec_peer_lookup_timeout_s": 0},
            "ec_both",
            "positive",
        ),
        ({"ec_peer_lease_s": 60}, "ec_both", "set ec_peer_listen or ec_peers"),
        (
            {"ec_peer_listen": "h:1", "ec_peer_handle_lease_s": 31},
            "ec_both",
            "must not exceed ec_peer_lease_s",
        ),
        (
            {"ec_peer_listen": "h:1", "ec_peer_handle_lease_s": -1},
            "ec_both",
            "0 or a finite, positive",
        ),
        (
            {"ec_peer_listen": "h:1", "ec_peer_handle_lease_s": True},
            "ec_both",
            "number of seconds",
        ),
    ],
)
def test_malformed_peer_settings_name_the_key_and_hide_the_secret(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any], role: str, needle: str
) -> None:
    if "ec_peer_listen" in extra or "ec_peers" in extra:
        monkeypatch.setenv(SECRET_ENV, SECRET)
    else:  # a secret alone would turn the layer on
        monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="ec_connector_extra_config") as info:
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, **extra}, block_size_bytes=512, role=role
        )
    assert needle in str(info.value)
    assert "short" not in str(info.value) and SECRET not in str(info.value)


def test_peer_keys_are_known_keys(
    monkeypatch: pytest.MonkeyPatch, ec_log: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    ECCPUSettings.from_extra_config(
        {"ec_cpu_bytes": 4096, "ec_peers": ["h:1"]},
        block_size_bytes=512,
        role="ec_both",
    )
    assert not any("unknown" in r.getMessage() for r in ec_log.records)


def test_handle_leases_are_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    base = {"ec_cpu_bytes": 4096, "ec_peer_listen": "h:1"}
    settings = ECCPUSettings.from_extra_config(base, block_size_bytes=512, role="ec_both")
    assert settings.peers is not None and settings.peers.handle_lease_s == 0
    settings = ECCPUSettings.from_extra_config(
        {**base, "ec_peer_handle_lease_s": "2.5"}, block_size_bytes=512, role="ec_both"
    )
    assert settings.peers is not None and settings.peers.handle_lease_s == 2.5


def test_a_secret_that_is_not_utf8_text_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Random bytes exported as the secret reach Python as lone surrogates; accepted,
    the engine failed later with UnicodeEncodeError where the secret is encoded
    (report channel, NIXL transport), after the early check had passed."""
    monkeypatch.setenv(SECRET_ENV, "\udcff\udcfe" + SECRET)
    with pytest.raises(ValueError, match=rf"\${SECRET_ENV}: secret 1 of 1 .*UTF-8") as info:
        parse_peer_settings({"ec_peers": ["h:1"]}, "ec_consumer")
    assert SECRET not in str(info.value)
    monkeypatch.delenv(SECRET_ENV)
    path = _private(tmp_path / "bytes", b"\xff\xfe" + SECRET.encode() + b"\n")
    with pytest.raises(ValueError, match=r"\['ec_peer_secret_file'\] = .*bytes.*not UTF-8"):
        parse_peer_settings({"ec_peers": ["h:1"], "ec_peer_secret_file": path}, None)
    path = _private(tmp_path / "text", "pässwörter\n".encode())
    text = parse_peer_settings({"ec_peers": ["h:1"], "ec_peer_secret_file": path}, None)
    assert text is not None and text.secret.encode() == "pässwörter".encode()


def test_an_ipv6_literal_keeps_its_brackets_wherever_it_is_written() -> None:
    """`[::1]:5710` was accepted, then written `::1:5710`: no ZeroMQ endpoint, and a
    handle's peer that no longer parses."""
    address = PeerAddress.parse("ec_peer_listen", "[::1]:5710")
    assert address == PeerAddress("::1", 5710) and address.is_ipv6
    assert str(address) == "[::1]:5710"
    assert address.endpoint == "tcp://[::1]:5710"
    assert PeerAddress.parse("ec_transfer_params.peer", str(address)) == address
    plain = PeerAddress.parse("ec_peers", "10.0.0.5:5710")
    assert not plain.is_ipv6 and plain.endpoint == "tcp://10.0.0.5:5710"
    assert str(PeerAddress.parse("ec_peers", "encoder-0.local:5710")) == "encoder-0.local:5710"


def test_an_empty_secret_in_the_environment_is_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """`EC_CPU_TIER_PEER_SECRET=` (set, but empty: a template's default, an unset
    variable passed through) is no secret: an engine with no peer key runs without
    the cross-engine layer. It was taken for a secret too short and refused the
    engine, saying a secret is required "with ec_peer_listen or ec_peers", neither
    of which was set. A peer key still needs a real secret."""
    monkeypatch.setenv(SECRET_ENV, "")
    assert parse_peer_settings({}, "ec_both") is None
    settings = ECCPUSettings.from_extra_config(
        {"ec_cpu_bytes": 4096}, block_size_bytes=512, role="ec_both"
    )
    assert settings.peers is None
    with pytest.raises(ValueError, match=r"shared secret .*EC_CPU_TIER_PEER_SECRET"):
        parse_peer_settings({"ec_peers": ["h:1"]}, "ec_consumer")


def test_each_data_parallel_engine_listens_on_the_port_plus_its_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every engine of a data-parallel deployment gets the same config; all of them
    bound the same port, so the second engine's start failed. Engine k listens on
    PORT + k (vLLM's NIXL side channel does the same)."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    extra = {"ec_peer_listen": "10.0.0.5:5710"}
    for index in (0, 1, 7):
        peers = parse_peer_settings(extra, "ec_producer", dp_index=index)
        assert peers is not None and peers.listen == PeerAddress("10.0.0.5", 5710 + index)
    six = parse_peer_settings({**extra, "ec_peer_listen": "[::1]:6000"}, "ec_both", dp_index=2)
    assert six is not None and str(six.listen) == "[::1]:6002"
    settings = ECCPUSettings.from_extra_config(
        {"ec_cpu_bytes": 4096, **extra}, block_size_bytes=512, role="ec_both", dp_index=3
    )
    assert settings.peers is not None and settings.peers.listen == PeerAddress("10.0.0.5", 5713)
    last = parse_peer_settings({**extra, "ec_peer_listen": "h:65534"}, "ec_both", dp_index=1)
    assert last is not None and last.listen == PeerAddress("h", 65535)


def test_a_data_parallel_port_past_65535_is_refused_naming_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    extra = {"ec_peer_listen": "h:65534"}
    with pytest.raises(ValueError, match=r"\['ec_peer_listen'\] = 'h:65534' is invalid") as info:
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, **extra}, block_size_bytes=512, role="ec_both", dp_index=2
        )
    assert "65536" in str(info.value) and "data-parallel engine 2" in str(info.value)
    # A consumer-only engine is told it cannot serve at all, whatever its index.
    with pytest.raises(ValueError, match="only ec_producer or ec_both serve"):
        parse_peer_settings(extra, "ec_consumer", dp_index=2)


def test_an_engine_does_not_ask_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The `ec_both` engines of a data-parallel deployment share one config, so a list
    naming all of them names each one itself too: it was refused ("lists this
    engine's own ec_peer_listen"), comparing the list with the configured port, which
    is engine 0's. Each engine leaves out its own address and asks the others."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    extra = {
        "ec_peer_listen": "10.0.0.5:5710",
        "ec_peers": ["10.0.0.5:5710", "10.0.0.5:5711", "10.0.0.6:5710"],
    }
    asked = {}
    for index in (0, 1, 2):
        peers = parse_peer_settings(extra, "ec_both", dp_index=index)
        assert peers is not None
        asked[index] = [str(p) for p in peers.peers]
    assert asked == {
        0: ["10.0.0.5:5711", "10.0.0.6:5710"],
        1: ["10.0.0.5:5710", "10.0.0.6:5710"],
        2: ["10.0.0.5:5710", "10.0.0.5:5711", "10.0.0.6:5710"],
    }


def test_an_inline_secret_is_refused_saying_why_and_what_instead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM logs its non-default args, the whole ec_transfer_config included, at INFO
    when it starts: a secret in the config lands in every engine's log. Refused with
    or without other peer keys, and with a secret in the environment too."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    for extra in (
        {"ec_peers": ["h:1"], "ec_peer_secret": SECRET},
        {"ec_peer_secret": SECRET},
        {"ec_peer_listen": "h:1", "ec_peer_secret": 12345678},
    ):
        with pytest.raises(ValueError, match=r"\['ec_peer_secret'\] = <hidden> is refused") as info:
            ECCPUSettings.from_extra_config(
                {"ec_cpu_bytes": 4096, **extra}, block_size_bytes=512, role="ec_both"
            )
        message = str(info.value)
        assert "vLLM logs the whole ec_transfer_config" in message
        assert SECRET_ENV in message and "ec_peer_secret_file" in message
        assert SECRET not in message and "12345678" not in message
    monkeypatch.setenv(SECRET_ENV, SECRET)
    with pytest.raises(ValueError, match="is refused"):
        parse_peer_settings({"ec_peers": ["h:1"], "ec_peer_secret": SECRET}, "ec_both")


def test_the_environment_may_hold_several_secrets_the_first_signs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SECRET_ENV, f" {SECRET}-new,{SECRET}\n {SECRET}-old ")
    peers = parse_peer_settings({"ec_peers": ["h:1"]}, "ec_consumer")
    assert peers is not None
    assert peers.secrets == (f"{SECRET}-new", SECRET, f"{SECRET}-old")
    assert peers.secret == f"{SECRET}-new" and peers.secret_file is None
    keyring = peers.keyring()
    assert keyring.signing == f"{SECRET}-new".encode()
    assert keyring.accepted == tuple(s.encode() for s in peers.secrets)
    assert SECRET not in repr(peers)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (f"{SECRET},tiny", "secret 2 of 2 is shorter than 8"),
        (f"{SECRET} {SECRET}", "listed twice"),
        (" , ", "holds no secret"),
    ],
)
def test_an_unusable_secret_in_the_environment_is_refused_unshown(
    monkeypatch: pytest.MonkeyPatch, value: str, needle: str
) -> None:
    monkeypatch.setenv(SECRET_ENV, value)
    with pytest.raises(ValueError, match=rf"^\${SECRET_ENV}") as info:
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_peers": ["h:1"]}, block_size_bytes=512, role="ec_both"
        )
    assert needle in str(info.value)
    assert SECRET not in str(info.value) and "tiny" not in str(info.value)


def test_a_secret_file_holds_one_secret_a_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = _private(tmp_path / "secret", f"\n  {SECRET}-b  \n\n{SECRET}, with a comma\n".encode())
    peers = parse_peer_settings({"ec_peer_listen": "h:1", "ec_peer_secret_file": path}, None)
    assert peers is not None and peers.secret_file == path
    assert peers.secrets == (f"{SECRET}-b", f"{SECRET}, with a comma")
    assert SECRET not in repr(peers)
    # A file alone turns the layer on, as a secret in the environment does.
    alone = parse_peer_settings({"ec_peer_secret_file": path}, "ec_consumer")
    assert alone is not None and alone.peers == ()


@pytest.mark.parametrize("mode", [0o640, 0o644, 0o604, 0o660, 0o606, 0o700 | 0o010])
def test_a_secret_file_others_may_access_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: int
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = _private(tmp_path / "secret", SECRET.encode(), mode)
    with pytest.raises(ValueError, match="chmod 600") as info:
        ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": 4096, "ec_peers": ["h:1"], "ec_peer_secret_file": path},
            block_size_bytes=512,
            role="ec_both",
        )
    message = str(info.value)
    assert message.startswith(f"ec_connector_extra_config['ec_peer_secret_file'] = {path!r}")
    assert f"mode {mode:04o}" in message and "chmod 600" in message
    assert SECRET not in message


def test_a_secret_file_must_be_an_absolute_private_regular_file_of_this_user(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    good = _private(tmp_path / "good", SECRET.encode())
    cases: list[tuple[object, str]] = [
        ("relative/secret", "expected an absolute path"),
        (str(tmp_path / "missing"), "cannot be opened"),
        (str(tmp_path), "is not a regular file"),
        (_private(tmp_path / "empty", b"\n \n"), "holds no secret"),
        (_private(tmp_path / "short", b"short\n"), "secret 1 of 1 is shorter than 8"),
        (_private(tmp_path / "twice", f"{SECRET}\n{SECRET}\n".encode()), "listed twice"),
        (_private(tmp_path / "huge", b"x" * 70_000), "larger than"),
        (42, "expected the absolute path"),
        ("", "expected the absolute path"),
    ]
    for value, needle in cases:
        with pytest.raises(ValueError, match="ec_peer_secret_file") as info:
            parse_peer_settings({"ec_peers": ["h:1"], "ec_peer_secret_file": value}, None)
        assert needle in str(info.value), (value, str(info.value))
        assert SECRET not in str(info.value)
    other = os.geteuid() + 1
    monkeypatch.setattr(os, "geteuid", lambda: other)
    with pytest.raises(ValueError, match=r"is owned by uid \d+, not by this engine's user"):
        parse_peer_settings({"ec_peers": ["h:1"], "ec_peer_secret_file": good}, None)


def test_a_secret_in_the_environment_and_a_file_is_ambiguous(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Refused, not ranked: a forgotten variable would silently win or lose."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    path = _private(tmp_path / "secret", f"{SECRET}-file".encode())
    with pytest.raises(ValueError, match=r"\['ec_peer_secret_file'\].*EC_CPU_TIER_PEER_SECRET"):
        parse_peer_settings({"ec_peers": ["h:1"], "ec_peer_secret_file": path}, None)
