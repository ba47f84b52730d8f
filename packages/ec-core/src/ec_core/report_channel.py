"""Worker reports that vLLM drops, carried to the scheduler on a side channel.

vLLM 0.32's V1 model runner, on an encode-only engine (role `ec_producer`
alone), runs the encoder and returns an output without the connector's worker
metadata: the scheduler would never learn that a save landed, and its entries
would stay "saving" for ever. On such an engine, when it serves peers
(`ec_peer_listen`), every worker also sends each report here, and the
scheduler drains the channel every step and whenever a peer asks for an entry.

The channel is a ZeroMQ PUSH (workers) / PULL (scheduler) pair on an abstract
Unix socket named after the region file. Any local process can connect to an
abstract socket, so each message carries an HMAC-SHA256 under the peers'
shared secret; a message that does not verify is dropped (a forged save ack
would otherwise announce bytes that were never written). ZeroMQ is imported
only when a channel is built.

Runs in the worker processes (ReportSender) and the scheduler process
(ReportReceiver).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import os
from typing import TYPE_CHECKING, Any

from ec_core._vllm import get_logger
from ec_core.metadata import ECCPUWorkerReport
from ec_core.peer_secrets import signed_by_any
from ec_core.ratelimit import RateLimitedWarnings

if TYPE_CHECKING:
    from ec_core.peer_secrets import PeerSecrets

logger = get_logger(__name__)

SEND_HWM = 10_000
"""Reports queued for a scheduler that is not draining; beyond, reports are
dropped (the scheduler's settlement then treats those copies as unreported)."""

DRAIN_MAX = 10_000
"""Messages one `drain` takes at most; the rest wait for its next call, so a local
process that floods the channel cannot keep the scheduler in it."""

MAX_STAT = float(2**63)
"""Largest worker figure (bytes or seconds of one report) a report may carry."""


def needed(vllm_config: Any, *, listening: bool) -> bool:
    """Whether this engine's reports need the side channel (see the module docstring)."""
    return listening and drops_reports(vllm_config)


def drops_reports(vllm_config: Any) -> bool:
    """Whether vLLM drops this engine's worker reports: an encode-only engine on the
    V1 model runner. Without the side channel its saves never become ready."""
    ec_config = vllm_config.ec_transfer_config
    encode_only = bool(ec_config.is_ec_producer) and not bool(ec_config.is_ec_consumer)
    return encode_only and not bool(getattr(vllm_config, "use_v2_model_runner", False))


def endpoint(region_path: str | os.PathLike[str]) -> str:
    """The channel's address for the engine that owns `region_path`."""
    # The path's bytes: a directory named in bytes that are not UTF-8 is a valid
    # ec_cpu_dir, and strict UTF-8 would refuse its lone surrogates.
    digest = hashlib.sha256(os.fsencode(region_path)).hexdigest()[:32]
    return f"ipc://@ec-cpu-tier-reports-{digest}"


def encode(report: ECCPUWorkerReport, secret: bytes) -> list[bytes]:
    payload = json.dumps(dataclasses.asdict(report), separators=(",", ":")).encode()
    return [payload, hmac.new(secret, payload, hashlib.sha256).digest()]


def decode(frames: list[bytes], accepted: tuple[bytes, ...]) -> ECCPUWorkerReport:
    """The report in `frames`; ValueError when it must be dropped.

    Nothing else is raised, whatever the frames hold (a field of the wrong type,
    a missing one, a number too large for its field, nesting too deep to parse).
    """
    if len(frames) != 2:
        raise ValueError(f"expected 2 frames, got {len(frames)}")
    payload, mac = frames
    # Any of the engine's secrets: its worker may take a rolled secret file a moment
    # before or after its scheduler does (`ec_core.peer_secrets`).
    if not signed_by_any(mac, payload, accepted):
        raise ValueError("not signed with any of this engine's peer secrets")
    try:
        return _report(json.loads(payload))
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        raise ValueError(f"malformed report: {type(e).__name__}: {e}") from e


def _report(data: Any) -> ECCPUWorkerReport:
    return ECCPUWorkerReport(
        completed_saves=[str(k) for k in data["completed_saves"]],
        completed_loads=[int(t) for t in data["completed_loads"]],
        progress=[(int(r), int(s), int(d)) for r, s, d in data["progress"]],
        group_size=int(data["group_size"]),
        save_acks=[(int(r), int(s), str(k)) for r, s, k in data["save_acks"]],
        failed_saves=[(int(r), int(s), str(k)) for r, s, k in data["failed_saves"]],
        load_acks=[(int(r), int(t)) for r, t in data["load_acks"]],
        fallbacks=[(int(r), str(kind)) for r, kind in data["fallbacks"]],
        stats={str(k): _stat(v) for k, v in data["stats"].items()},
    )


def _stat(value: Any) -> float:
    """A worker figure as a float: ValueError unless it is between 0 and `MAX_STAT`.

    The scheduler adds each figure to a counter for good: a NaN, an infinity or a
    negative figure would leave that counter NaN, infinite or going backwards.
    """
    number = float(value)
    if not 0.0 <= number <= MAX_STAT:  # NaN compares False
        raise ValueError(f"stats value out of range: {value!r}")
    return number


class _End:
    """One end of the channel: its own ZeroMQ context and socket (LINGER 0)."""

    def __init__(self, kind: str, keys: PeerSecrets) -> None:
        import zmq

        self._zmq = zmq
        self._keys = keys
        self._context: Any = zmq.Context()
        self._socket: Any = self._context.socket(getattr(zmq, kind))
        self._socket.setsockopt(zmq.LINGER, 0)

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()


class ReportSender(_End):
    """A worker's end: `send` never blocks and never raises for a missing scheduler."""

    def __init__(self, address: str, keys: PeerSecrets) -> None:
        super().__init__("PUSH", keys)
        self._socket.setsockopt(self._zmq.SNDHWM, SEND_HWM)
        self._socket.connect(address)

    def send(self, report: ECCPUWorkerReport) -> None:
        with contextlib.suppress(self._zmq.Again):  # the queue is full: dropped
            self._socket.send_multipart(encode(report, self._keys.signing), self._zmq.NOBLOCK)


class ReportReceiver(_End):
    """The scheduler's end: `drain` returns the reports sent since the last call."""

    def __init__(self, address: str, keys: PeerSecrets) -> None:
        super().__init__("PULL", keys)
        self._socket.bind(address)
        self.dropped = 0
        """Messages that did not verify or decode."""
        self._warn = RateLimitedWarnings(logger).warn

    def drain(self) -> list[ECCPUWorkerReport]:
        """Never raises for a message: one that does not verify or decode is counted in
        `dropped` and warned about (one line a minute). Takes DRAIN_MAX messages at most."""
        reports: list[ECCPUWorkerReport] = []
        for _ in range(DRAIN_MAX):
            try:
                frames = self._socket.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                break
            try:
                reports.append(decode(frames, self._keys.accepted))
            except ValueError as e:
                self.dropped += 1
                self._warn("dropped", "EC CPU tier: dropped a report on the side channel: %s", e)
        return reports
