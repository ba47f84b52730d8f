"""The main job: the EC CPU tier inside a real vLLM CPU engine, with a table.

    hatch run demo [--images N] [--passes P]

Builds a tiny random-weight BLIP-2 whose vision tower is heavy enough to cost
real time per image on a CPU and whose encoder outputs have a real VLM's size
(`REALISTIC`: 128 x 1024 fp32, 512 KiB per image; offline, no model hub), then
runs the same repeated-image workload twice — without and with
`ECCPUTierConnector` (`ec_both`) — each in a fresh engine process, and prints
what the tier did. vLLM's own encoder cache holds 2 images, so every repeat of
an image it has forgotten is either encoded again (without) or loaded from the
region (with). Pass 1 is cold; the repeat passes are timed one by one and the
speed-up is the ratio of their medians. "Engine start" is measured here, from
launching the engine process to its first request, for both sides alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ectools.engine import EngineSpec, launch
from ectools.tiny_blip2 import REALISTIC, build_tiny_blip2

ROOT = Path(__file__).resolve().parents[1]


class Ticker:
    """Prints what is happening, and a heartbeat while nothing is printed."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.status = ""
        self.since = self.last_print = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def say(self, message: str) -> None:
        self.status = message
        self.since = self.last_print = time.monotonic()
        self._print(message)

    def _print(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def _beat(self) -> None:
        while not self._stop.wait(1.0):
            now = time.monotonic()
            if self.status and now - self.last_print >= 5:
                self.last_print = now
                self._print(f"  ... still {self.status} ({now - self.since:.0f} s)")


def run_engine(spec: EngineSpec, label: str, ticker: Ticker) -> dict[str, Any]:
    ticker.say(f"{label}: starting a vLLM CPU engine")
    launched = time.monotonic()
    proc = launch(spec, stderr=subprocess.PIPE)
    ready_after_launch: float | None = None
    stderr: list[str] = []
    drain = threading.Thread(target=lambda: stderr.extend(proc.stderr or []), daemon=True)
    drain.start()
    result: dict[str, Any] | None = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("PROGRESS "):
            event = json.loads(line[len("PROGRESS ") :])
            if event["event"] == "ready":
                ready_after_launch = time.monotonic() - launched
                ticker.say(
                    f"{label}: engine ready {ready_after_launch:.1f} s after launch; running pass 1"
                )
            elif event["event"] == "pass":
                done, total = event["number"], event["of"]
                after = f"; running pass {done + 1}" if done < total else ""
                ticker.say(f"{label}: pass {done}/{total} took {event['seconds']:.2f} s{after}")
        elif line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    proc.wait()
    drain.join(5)
    if proc.returncode != 0 or result is None:
        sys.stderr.write("".join(stderr[-80:]))
        raise SystemExit(f"{label}: the engine failed (exit {proc.returncode})")
    ticker.say(f"{label}: done, engine shut down")
    result["ready_after_launch_s"] = ready_after_launch
    return result


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def print_table(
    plain: dict[str, Any], tier: dict[str, Any], passes: list[list[int]], region_dir: str
) -> None:
    counters = tier["counters"] or {}
    requests = sum(len(p) for p in passes)
    rows: list[tuple[str, str, str]] = [
        ("requests", str(requests), str(requests)),
        ("encoder runs (items encoded)", str(plain["encoded_items"]), str(tier["encoded_items"])),
        ("encoder runs avoided", "-", str(plain["encoded_items"] - tier["encoded_items"])),
        (
            "region hits / misses",
            "-",
            f"{counters.get('hits', 0)} / {counters.get('lookups', 0) - counters.get('hits', 0)}",
        ),
        (
            "entries saved / loaded",
            "-",
            f"{counters.get('saves_completed', 0)} / {counters.get('loads_completed', 0)}",
        ),
        (
            "bytes saved / loaded",
            "-",
            f"{_mib(counters.get('save_bytes', 0))} / {_mib(counters.get('load_bytes', 0))}",
        ),
        (
            "engine start (launch to ready)",
            f"{plain['ready_after_launch_s']:.1f} s",
            f"{tier['ready_after_launch_s']:.1f} s",
        ),
    ]
    for number, (a, b) in enumerate(zip(plain["pass_seconds"], tier["pass_seconds"], strict=True)):
        kind = "cold" if number == 0 else "repeat"
        rows.append(
            (
                f"pass {number + 1} time ({len(passes[number])} requests, {kind})",
                f"{a:.2f} s",
                f"{b:.2f} s",
            )
        )
    median_a = statistics.median(plain["pass_seconds"][1:])
    median_b = statistics.median(tier["pass_seconds"][1:])
    rows.append(("repeat pass, median", f"{median_a:.2f} s", f"{median_b:.2f} s"))
    same = plain["passes"] == tier["passes"]
    rows.append(("outputs token-identical", "", "yes" if same else "NO"))
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'':<{width}}  {'without connector':>20}  {'with ECCPUTierConnector':>24}")
    for name, a, b in rows:
        print(f"{name:<{width}}  {a:>20}  {b:>24}")
    if median_b > 0:
        spread = sorted(
            a / b for a, b in zip(plain["pass_seconds"][1:], tier["pass_seconds"][1:], strict=True)
        )
        print(
            f"\nA repeat pass ran {median_a / median_b:.2f}x faster with the CPU tier "
            f"(ratio of the medians of {len(spread)} repeat passes; pass by pass "
            f"{spread[0]:.2f}x to {spread[-1]:.2f}x)."
        )
    print(
        f"Region directory: {region_dir} (left empty by the clean shutdown: "
        f"{'yes' if not list(Path(region_dir).glob('ec_cpu_tier_*')) else 'NO'})"
    )
    if not same:
        raise SystemExit("outputs differ between the two runs")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=12, help="distinct images (default 12)")
    parser.add_argument("--passes", type=int, default=5, help="passes over them (default 5)")
    parser.add_argument("--model-dir", default=str(ROOT / "build" / "demo" / REALISTIC.tag()))
    args = parser.parse_args()
    # Refused before the engines start (minutes): the table times the repeat passes.
    if args.images < 1:
        parser.error("--images must be at least 1")
    if args.passes < 2:
        parser.error("--passes must be at least 2: pass 1 is cold, the repeat passes are compared")
    images = list(range(args.images))
    passes = [images] + [images[::-1] if p % 2 else images for p in range(1, args.passes)]
    with Ticker() as ticker:
        entry_kib = REALISTIC.num_query_tokens * REALISTIC.text_hidden * 4 // 1024
        ticker.say(
            f"building the tiny BLIP-2 (vision: {REALISTIC.vision_layers} layers x "
            f"{REALISTIC.vision_hidden}, {REALISTIC.image_size} px; encoder output "
            f"{REALISTIC.num_query_tokens} x {REALISTIC.text_hidden} fp32 = {entry_kib} KiB "
            f"per image) in {args.model_dir}"
        )
        model_dir = str(build_tiny_blip2(args.model_dir, REALISTIC))
        region_dir = tempfile.mkdtemp(prefix="ec-demo-region-")
        common: dict[str, Any] = {
            "model_dir": model_dir,
            "passes": passes,
            "image_size": REALISTIC.image_size,
            "multiprocess": False,
            "max_num_batched_tokens": 256,
            "max_model_len": 256,
        }
        plain = run_engine(EngineSpec(**common), "without connector", ticker)
        tier = run_engine(
            EngineSpec(
                **common,
                connector="ECCPUTierConnector",
                extra={"ec_cpu_bytes": "64MiB", "ec_cpu_dir": region_dir},
            ),
            "with ECCPUTierConnector",
            ticker,
        )
    print_table(plain, tier, passes, region_dir)
    os.rmdir(region_dir)


if __name__ == "__main__":
    main()
