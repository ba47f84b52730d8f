"""Servers started by `ectools.serving` do not outlive the demo or benchmark that
started them (no engine: stand-in processes in sessions of their own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ectools import serving
from ectools.process_groups import process_state


def _gone(pid: int, within_s: float = 60.0) -> bool:
    """No such process, or only its zombie (its parent has not reaped it yet), within
    `within_s` (CI slack: a killed process normally goes within milliseconds)."""
    deadline = time.monotonic() + within_s
    while True:
        found = process_state(pid)
        if found is None or found[0] == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_stop_ends_the_group_of_a_server_whose_leader_already_exited() -> None:
    # The leader (the API server) exits and leaves a child (its engine core) behind.
    leader = subprocess.Popen(
        ["bash", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE, start_new_session=True
    )
    assert leader.stdout is not None
    with leader.stdout:
        child = int(leader.stdout.readline())
    leader.wait(10)
    try:
        serving.stop([leader])
        assert _gone(child)
    finally:
        if not _gone(child, 0):
            os.kill(child, signal.SIGKILL)


def test_stop_lets_the_whole_group_finish_its_shutdown(tmp_path: Path) -> None:
    """The leader has exited; the process it left takes 0.5 s after SIGTERM to clean
    up (as an engine core's worker removes its region file) and gets that time."""
    marker = tmp_path / "region"
    marker.touch()
    cleanup = (
        f"trap 'sleep 0.5; rm -f {marker}; exit 0' TERM; echo trapped; while :; do sleep 0.1; done"
    )
    leader = subprocess.Popen(
        ["bash", "-c", f'(bash -c "{cleanup}") & echo $!'],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert leader.stdout is not None
    with leader.stdout:
        child = int(leader.stdout.readline())
        assert leader.stdout.readline() == "trapped\n"  # its handler is in place
    leader.wait(10)
    try:
        serving.stop([leader])
        assert not marker.exists(), "SIGKILLed before it had cleaned up"
        assert _gone(child, 0)
    finally:
        if not _gone(child, 0):
            os.kill(child, signal.SIGKILL)


SCRIPT = """
import subprocess, sys, time
from ectools import serving
from ectools.process_groups import process_state
serving.exit_on_termination()
procs = []
try:
    procs.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
    print(procs[0].pid, flush=True)
    time.sleep(60)
finally:
    serving.stop(procs)
"""


def test_a_terminated_caller_still_stops_its_servers() -> None:
    caller = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    assert caller.stdout is not None
    with caller.stdout:
        server = int(caller.stdout.readline())
    try:
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(30) == 128 + signal.SIGTERM
        assert _gone(server)
    finally:
        if not _gone(server, 0):
            os.kill(server, signal.SIGKILL)
