"""The side channel that carries worker reports vLLM drops (encode-only engines on V1)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import time

import pytest

from ec_core import report_channel
from ec_core.metadata import ECCPUWorkerReport
from ec_core.peer_secrets import PeerSecrets

SECRET = b"side-channel-secret"
KEYS = PeerSecrets((SECRET.decode(),))


def _report() -> ECCPUWorkerReport:
    return ECCPUWorkerReport(
        completed_saves=["a"],
        completed_loads=[3],
        progress=[(0, 7, 6)],
        group_size=2,
        save_acks=[(0, 7, "a")],
        failed_saves=[(1, 7, "b")],
        load_acks=[(0, 3)],
        fallbacks=[(1, "save")],
        stats={"bytes_saved": 4096.0},
    )


def test_a_report_survives_the_wire_unchanged() -> None:
    assert report_channel.decode(report_channel.encode(_report(), SECRET), (SECRET,)) == _report()


@pytest.mark.parametrize(
    "frames",
    [
        report_channel.encode(_report(), b"another-secret"),
        [b'{"completed_saves": []}', b"x" * 32],
        [b"only one frame"],
    ],
)
def test_a_message_not_signed_with_the_secret_or_malformed_is_refused(
    frames: list[bytes],
) -> None:
    with pytest.raises(ValueError, match=r"signed|frames"):
        report_channel.decode(frames, (SECRET,))


def _signed(payload: bytes) -> list[bytes]:
    return [payload, hmac.new(SECRET, payload, hashlib.sha256).digest()]


def _with(**fields: object) -> bytes:
    return json.dumps({**dataclasses.asdict(_report()), **fields}).encode()


HOSTILE = [
    _with(stats=[1, 2]),  # stats not a dict
    _with(stats="bytes_saved"),
    _with(group_size=1e400),  # parses as inf: int() overflows
    _with(progress=[[0, 1e400, 0]]),
    _with(stats={"bytes_saved": 10**400}),  # too large for a float
    b"[" * 100_000 + b"]" * 100_000,  # nested too deep to parse
    b"[1, 2]",
    b"\xff\xfe",
]


@pytest.mark.parametrize("payload", HOSTILE)
def test_a_signed_but_malformed_report_is_refused_with_value_error(payload: bytes) -> None:
    with pytest.raises(ValueError, match="malformed"):
        report_channel.decode(_signed(payload), (SECRET,))


@pytest.mark.parametrize(
    "value", ["NaN", "Infinity", "-Infinity", "-4096", '"nan"', '"inf"', "1e300"]
)
def test_a_report_whose_stats_are_out_of_range_is_refused(value: str) -> None:
    # The scheduler adds each figure to a counter for good: a NaN would make
    # vllm:ec_cpu_bytes_saved NaN (and published every step) from then on.
    payload = _with(stats={}).replace(
        b'"stats": {}', b'"stats": {"bytes_saved": ' + value.encode() + b"}"
    )
    assert b"bytes_saved" in payload
    with pytest.raises(ValueError, match="out of range"):
        report_channel.decode(_signed(payload), (SECRET,))


def test_drain_drops_malformed_reports_with_one_warning_and_keeps_the_good_ones(
    tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    address = report_channel.endpoint(f"{tmp_path}/region.mmap")
    receiver = report_channel.ReportReceiver(address, KEYS)
    sender = report_channel.ReportSender(address, KEYS)
    raw = sender._socket  # the worker's socket: sends signed frames as they are
    channel_logger = logging.getLogger("vllm.ec_cpu.ec_core.report_channel")
    channel_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            for payload in HOSTILE:
                raw.send_multipart(_signed(payload))
            sender.send(_report())
            got: list[ECCPUWorkerReport] = []
            began = time.monotonic()
            while receiver.dropped < len(HOSTILE) or not got:
                assert time.monotonic() - began < 60, "nothing arrived"
                got.extend(receiver.drain())  # never raises
                time.sleep(0.005)
        assert got == [_report()] and receiver.dropped == len(HOSTILE)
        # (a record reaches caplog's handler once or twice: here, and through the root)
        dropped = {id(r) for r in caplog.records if "dropped a report" in r.getMessage()}
        assert len(dropped) == 1  # rate-limited: one line for the burst
    finally:
        channel_logger.removeHandler(caplog.handler)
        sender.close()
        receiver.close()


def test_drain_returns_while_a_local_process_floods_the_channel(tmp_path: object) -> None:
    """Any local process can connect to the abstract socket and send faster than the
    scheduler checks messages: `drain` (called under the scheduler's lock, every step
    and at every peer lookup) must return anyway, the rest left for its next call,
    not spin while the flood lasts (the engine would hang)."""
    import zmq

    address = report_channel.endpoint(f"{tmp_path}/region.mmap")
    receiver = report_channel.ReportReceiver(address, KEYS)
    real = receiver._socket
    calls = [0]

    class Flooded:
        def recv_multipart(self, flags: int = 0) -> list[bytes]:
            calls[0] += 1
            if calls[0] > 200_000:  # the test's own stop: the flood never ends by itself
                raise zmq.Again()
            return [b"{}", b"\x00" * 32]  # not signed: dropped

    receiver._socket = Flooded()
    try:
        assert receiver.drain() == []
        assert calls[0] < 200_000, "drain ran as long as the flood lasted"
        assert receiver.dropped == calls[0]
    finally:
        receiver._socket = real
        receiver.close()


def test_reports_sent_by_a_worker_are_drained_by_the_scheduler(tmp_path: object) -> None:
    address = report_channel.endpoint(f"{tmp_path}/region.mmap")
    receiver = report_channel.ReportReceiver(address, KEYS)
    sender = report_channel.ReportSender(address, KEYS)
    forger = report_channel.ReportSender(address, PeerSecrets(("not-the-secret",)))
    try:
        forger.send(_report())
        sender.send(_report())
        got: list[ECCPUWorkerReport] = []
        began = time.monotonic()
        while not got or receiver.dropped == 0:
            assert time.monotonic() - began < 60, "nothing arrived"
            got.extend(receiver.drain())
            time.sleep(0.005)
        assert got == [_report()] and receiver.dropped == 1
    finally:
        forger.close()
        sender.close()
        receiver.close()


def test_only_an_encode_only_v1_engine_that_serves_peers_needs_it() -> None:
    class Config:
        def __init__(self, producer: bool, consumer: bool, v2: bool) -> None:
            self.ec_transfer_config = type(
                "EC", (), {"is_ec_producer": producer, "is_ec_consumer": consumer}
            )()
            self.use_v2_model_runner = v2

    assert report_channel.needed(Config(True, False, False), listening=True)
    assert not report_channel.needed(Config(True, False, False), listening=False)
    assert not report_channel.needed(Config(True, True, False), listening=True)
    assert not report_channel.needed(Config(True, False, True), listening=True)


def test_a_region_directory_whose_name_is_not_utf8_has_a_channel(tmp_path: object) -> None:
    """`ec_cpu_dir` may be any existing directory, its name in bytes that are not UTF-8
    too (Python reads them as lone surrogates): the settings accept it and the region
    is made there. The channel's address encoded the path as strict UTF-8, so an
    encode-only engine serving peers failed at start-up, in the scheduler and in
    every worker, with UnicodeEncodeError."""
    path = os.fsdecode(os.fsencode(f"{tmp_path}") + b"/cach\xe9/region.mmap")
    address = report_channel.endpoint(path)
    assert address.startswith("ipc://@ec-cpu-tier-reports-")
    assert address != report_channel.endpoint(f"{tmp_path}/cach/region.mmap")
    # A UTF-8 path keeps its address (workers and scheduler of one version agree anyway).
    utf8 = f"{tmp_path}/région.mmap"
    digest = hashlib.sha256(utf8.encode()).hexdigest()[:32]
    assert report_channel.endpoint(utf8) == f"ipc://@ec-cpu-tier-reports-{digest}"
