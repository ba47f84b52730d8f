"""The main job: the EC CPU tier inside a real vLLM CPU engine, with a table.

    hatch run demo [--images N] [--passes P]

Builds a tiny random-weight BLIP-2 whose vision tower is heavy enough to cost
real time per image on a CPU (offline, no model hub), then runs the same
repeated-image workload twice — without and with `ECCPUTierConnector`
(`ec_both`) — each in a fresh engine process, and prints what the tier did.
vLLM's own encoder cache holds 4 images, so every repeat of an image it has
forgotten is either encoded again (without) or loaded from the region (with).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ectools.engine import EngineSpec, launch
from ectools.tiny_blip2 import HEAVY_VISION, build_tiny_blip2

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
    stderr: list[str] = []
    drain = threading.Thread(target=lambda: stderr.extend(proc.stderr or []), daemon=True)
    drain.start()
    result: dict[str, Any] | None = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("PROGRESS "):
            event = json.loads(line[len("PROGRESS ") :])
            if event["event"] == "ready":
                ticker.say(
                    f"{label}: engine ready {time.monotonic() - launched:.1f} s after launch; "
                    "running pass 1"
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
        ("engine start", f"{plain['ready_s']:.1f} s", f"{tier['ready_s']:.1f} s"),
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
    total_a, total_b = sum(plain["pass_seconds"][1:]), sum(tier["pass_seconds"][1:])
    rows.append(("repeat passes, total", f"{total_a:.2f} s", f"{total_b:.2f} s"))
    same = plain["passes"] == tier["passes"]
    rows.append(("outputs token-identical", "", "yes" if same else "NO"))
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'':<{width}}  {'without connector':>20}  {'with ECCPUTierConnector':>24}")
    for name, a, b in rows:
        print(f"{name:<{width}}  {a:>20}  {b:>24}")
    if total_b > 0:
        print(f"\nRepeat passes ran {total_a / total_b:.2f}x faster with the CPU tier.")
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
    parser.add_argument("--passes", type=int, default=3, help="passes over them (default 3)")
    parser.add_argument("--model-dir", default=str(ROOT / "build" / "demo" / HEAVY_VISION.tag()))
    args = parser.parse_args()
    images = list(range(args.images))
    passes = [images] + [images[::-1] if p % 2 else images for p in range(1, args.passes)]
    with Ticker() as ticker:
        ticker.say(
            f"building the tiny BLIP-2 (vision: {HEAVY_VISION.vision_layers} layers x "
            f"{HEAVY_VISION.vision_hidden}, {HEAVY_VISION.image_size} px) in {args.model_dir}"
        )
        model_dir = str(build_tiny_blip2(args.model_dir, HEAVY_VISION))
        region_dir = tempfile.mkdtemp(prefix="ec-demo-region-")
        common: dict[str, Any] = {
            "model_dir": model_dir,
            "passes": passes,
            "image_size": HEAVY_VISION.image_size,
            "multiprocess": False,
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
