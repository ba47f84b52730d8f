"""Cross-engine fetches vs a raw NIXL READ, and lookup round trips under load.

    hatch run bench-p2p [--repeats N]

Two processes on this host. The *producer* runs a real ECCPUScheduler with
`ec_peer_listen` over a real region (bf16 rows of width 4096, 8 KiB blocks),
saves entries of 1, 8 and 64 MB through a real CpuECCPUWorker, and then plays
a busy engine: its main thread takes the scheduler's lock for every "step"
and runs matrix products for the rest of the step (20 ms or 200 ms) on one
core. The *consumer* measures, side by side in the same run:

* fetch: a real ECCPUScheduler with `ec_peers` asked by 1 request, then by
  many requests at once (one entry each), calling `ensure_cache_available`
  for each and `build_connector_meta` after each pass, as vLLM's engine loop
  does, until none defers (lookup, lease, reservation, NIXL READ, ready); and raw
  NIXL READs of the same sizes and number between two plain agents in the
  same two processes (without a notification, like a fetch's READ);
* fetch with a handle: the same, but each request carries the request-level
  handle the producer's `request_finished` returned for its entry just before
  (made outside the clock, as an encoder's response would bring it): the
  consumer, which knows the producer's agent from the rows before, READs at
  once and confirms the handle's lease (a claim) while the READ runs;
* lookup round trip: 1, 8 and 64 concurrent signed lookups of a ready item
  from as many DEALER sockets (consumers), each answered with a lease, then
  released: p50 and p99 at the client (the clock starts before the send and
  stops when the client's poll reports the reply there), and the server
  thread's time per lookup (its busy time over the lookups it answered) and
  how many lookups it answered per batch.

Everything runs twice: with UCX's default transports (same host: shared
memory or CMA) and with `UCX_TLS=tcp` (what a cross-node path without RDMA
looks like).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WIDTH = 4096
SIZES_MB = (1, 8, 64)
BATCH = {1: 32, 8: 8, 64: 2}
"""Entries fetched at once per size (as many concurrent requests, one item each)."""
SECRET = "bench-p2p-secret-1"
STEPS_S = (0.02, 0.2)
"""The producer engine's step lengths during the lookup rounds."""
CONCURRENCY = (1, 8, 64)


def _config(model: str, region: Path, role: str, **peer: Any) -> Any:
    from ectools.configs import make_vllm_config

    # Through the environment, as engines take it (a secret in the config is refused).
    os.environ["EC_CPU_TIER_PEER_SECRET"] = SECRET
    extra = {"ec_cpu_bytes": "600MiB", "ec_cpu_dir": str(region)}
    extra.update(peer)
    return make_vllm_config(
        model, role=role, extra=extra, widths={"image": WIDTH}, dtype="bfloat16"
    )


def _rows(mb: int) -> int:
    return mb * 2**20 // (WIDTH * 2)


def _pattern(nbytes: int) -> Any:
    """The raw READ's source bytes: a period of 251 (a prime), so a READ that moved
    nothing, or read from another entry's offset, leaves bytes that differ."""
    import torch

    return torch.arange(251, dtype=torch.uint8).repeat(-(-nbytes // 251))[:nbytes]


def _producer(model: str, region: str, address: str, pipe: Any) -> None:
    """Save the entries, offer a raw buffer, then run busy engine steps until told to stop."""
    import torch

    from ec_core.worker_process.ranks import RankInfo
    from ec_scheduler import ECCPUScheduler
    from ec_transfer_nixl.agent import RegionAgent
    from ec_worker_cpu.worker import CpuECCPUWorker
    from ectools.driving import Item, StepDriver, connector_output, make_request

    # Handle leases are opt-in; the `handle` rows measure them.
    config = _config(
        model, Path(region), "ec_both", ec_peer_listen=address, ec_peer_handle_lease_s=10
    )
    scheduler = ECCPUScheduler(config)
    worker = CpuECCPUWorker(config, rank_info=RankInfo(0, True))
    for mb in SIZES_MB:
        for j in range(BATCH[mb]):
            key = f"entry-{mb}MB-{j}"
            meta = StepDriver(scheduler).step([make_request(key, [Item(key, _rows(mb))])]).meta
            worker.bind(meta)
            worker.save_caches({key: torch.randn(_rows(mb), WIDTH).to(torch.bfloat16)}, key, meta)
            worker.get_finished()
            scheduler.update_connector_output(
                connector_output(worker.build_connector_worker_meta())
            )
    raw = _pattern(max(mb * BATCH[mb] for mb in SIZES_MB) * 2**20)
    raw_agent = RegionAgent(f"bench-raw-producer-{os.getpid()}", raw.data_ptr(), raw.numel())
    pipe.send((raw_agent.name, raw_agent.metadata, raw.data_ptr()))
    stop = threading.Event()

    def notifications() -> None:  # progress on the READ's target (TCP needs it)
        while not stop.is_set():
            raw_agent.notifications()
            time.sleep(0.0005)

    threading.Thread(target=notifications, daemon=True).start()
    server = scheduler.remote.server  # type: ignore[union-attr]
    # The engine's forward takes one core, as an engine's would: the server
    # thread and the consumer share the other one of this 2-core machine.
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    step_s = STEPS_S[0]
    while True:
        if pipe.poll():
            message = pipe.recv()
            if message == "stop":
                break
            if message == "answers":  # the server thread's own time per lookup
                io = _zmq_io_cpu()
                pipe.send(
                    (server.busy_seconds, server.lookups_answered, list(server.batch_sizes), io)
                )
                server.busy_seconds, server.lookups_answered = 0.0, 0
                server.batch_sizes.clear()
            elif isinstance(message, tuple) and message[0] == "handles":
                handles = []
                for key, rows in message[1]:
                    finished = make_request(f"h-{key}", [Item(key, rows)])
                    handles.append(scheduler.request_finished(finished)[1])
                pipe.send(handles)
            else:
                step_s = message
                pipe.send("ok")
            continue
        with scheduler.lock:  # a scheduler call of the busy engine
            scheduler.get_ec_connector_stats()
        began = time.perf_counter()
        while time.perf_counter() - began < step_s:  # the model's forward
            a = (a @ a).clamp_(-1, 1)
    stop.set()
    worker.shutdown()
    scheduler.shutdown()
    raw_agent.close()
    pipe.send("done")


def _zmq_io_cpu() -> float:
    """CPU seconds this process's ZeroMQ I/O threads used so far (Linux /proc)."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            if not (task / "comm").read_text().startswith("ZMQbg/IO"):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / os.sysconf("SC_CLK_TCK")


def _percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 in ms."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return ordered[len(ordered) // 2] * 1e3, p99 * 1e3


def _measure(model: str, region: Path, address: str, repeats: int) -> list[str]:
    import torch
    import zmq

    from ec_scheduler import ECCPUScheduler
    from ec_transfer_nixl.agent import RegionAgent
    from ec_transfer_nixl.wire import Lookup, Release, Reply, open_frame, seal
    from ectools.driving import Item, make_request, scheduler_output

    ours, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=_producer, args=(model, str(region / "p"), address, theirs), daemon=True
    )
    (region / "p").mkdir()
    (region / "c").mkdir()
    proc.start()
    raw_name, raw_md, raw_addr = ours.recv()
    consumer = ECCPUScheduler(_config(model, region / "c", "ec_consumer", ec_peers=[address]))
    sink = torch.zeros(max(mb * BATCH[mb] for mb in SIZES_MB) * 2**20, dtype=torch.uint8)
    agent = RegionAgent(f"bench-raw-consumer-{os.getpid()}", sink.data_ptr(), sink.numel())
    peer = agent.know(raw_name, raw_md)
    expected = _pattern(sink.numel())
    count = 0

    def fetch(mb: int, n: int, *, handles: bool = False) -> float:
        """Seconds until `n` entries of `mb` MB, asked by `n` requests at once, are ready
        (with `handles`: each request carries its entry's handle, made before)."""
        nonlocal count
        requests = []
        for j in range(n):
            count += 1
            key = f"entry-{mb}MB-{j}"
            requests.append(make_request(f"r{count}", [Item(key, _rows(mb))]))
        if handles:
            ours.send(("handles", [(r.mm_features[0].identifier, _rows(mb)) for r in requests]))
            for request, params in zip(requests, ours.recv(), strict=True):
                assert params is not None and "lease" in params["ec_cpu_tier"]
                request.ec_transfer_params = params
        fast = consumer.remote.fetcher.handle_reads  # type: ignore[union-attr]
        began = time.perf_counter()
        waiting = list(requests)
        empty_step = scheduler_output(0)
        while waiting:  # like vLLM's engine loop: empty steps while requests are deferred
            waiting = [r for r in waiting if not consumer.ensure_cache_available(r, 0)]
            if waiting:
                consumer.build_connector_meta(empty_step)
                time.sleep(0.0001)
        took = time.perf_counter() - began
        if handles:  # every request's READ began before any answer
            assert consumer.remote.fetcher.handle_reads - fast == n  # type: ignore[union-attr]
        for request in requests:
            key = request.mm_features[0].identifier
            entry = consumer.allocator.get(key)
            assert entry is not None and entry.ready, "the fetch fell back"
            consumer.request_finished(request)
            with consumer.lock:
                consumer.allocator.drop(key)
        return took

    def raw_read(mb: int, n: int, *, verify: bool = False) -> float:
        """Seconds for `n` READs of `mb` MB each, started at once (no notification, as
        a fetch's READ has none). Every READ must end DONE (an ERR also ends the wait);
        with `verify`, the bytes that landed are checked too (outside the clock)."""
        nbytes = mb * 2**20
        if verify:
            sink[: n * nbytes].zero_()
        began = time.perf_counter()
        handles = [
            agent.read(
                peer,
                [((sink.data_ptr() + j * nbytes, nbytes), (raw_addr + j * nbytes, nbytes))],
            )
            for j in range(n)
        ]
        while any(agent.state(h) == "PROC" for h in handles):
            time.sleep(0.0001)
        took = time.perf_counter() - began
        states = [agent.state(h) for h in handles]
        assert states == ["DONE"] * n, f"a raw READ did not complete: {states}"
        for handle in handles:
            agent.release(handle)
        if verify:
            assert torch.equal(sink[: n * nbytes], expected[: n * nbytes]), "raw READ bytes"
        return took

    rows_out = []
    for label, handles in (("fetch ", False), ("handle", True)):
        for mb in SIZES_MB:
            for n in sorted({1, BATCH[mb]}):
                ours_s, raw_s = [], []
                for repeat in range(repeats + 1):  # the first is a warm-up, not counted
                    took_ours = fetch(mb, n, handles=handles)
                    took_raw = raw_read(mb, n, verify=not repeat)
                    if repeat:
                        ours_s.append(took_ours)
                        raw_s.append(took_raw)
                mine, raw = statistics.median(ours_s), statistics.median(raw_s)
                gbs = n * mb * 2**20 / 1e9
                rows_out.append(
                    f"{label} {n:>2} x {mb:>2} MB  {gbs / mine:6.2f} GB/s {mine * 1e3:7.2f} ms"
                    f"  {gbs / raw:6.2f} GB/s {raw * 1e3:7.2f} ms  {raw / mine:5.2f}"
                )
    secret = SECRET.encode()
    # The consumer's fetcher learned the producer's agent in the rows above: like it,
    # the lookups say so, and their replies carry no agent metadata.
    agent_name = next(iter(consumer.remote.fetcher._links.by_peer.values())).agent  # type: ignore[union-attr]
    context = zmq.Context()
    key, rows = "entry-1MB-0", _rows(1)
    for step_s in STEPS_S:
        ours.send(step_s)
        ours.recv()
        for clients in CONCURRENCY:
            sockets = []
            for _ in range(clients):
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"tcp://{address}")
                sockets.append(sock)
            time.sleep(0.2)  # connections up
            samples: list[float] = []
            ours.send("answers")  # reset the server's counts
            _, _, _, io_before = ours.recv()
            client_cpu, client_io = time.thread_time(), _zmq_io_cpu()
            for round_ in range(max(repeats * 4, 20)):
                # Sealed before the clock starts, and the replies checked after the
                # last one came: the client's own Python work is not the server's
                # latency. A reply's clock stops when the poll reports it there.
                sealed = [
                    seal(
                        Lookup(
                            round_ * 1000 + i,
                            time.time(),
                            consumer.remote.fingerprint,  # type: ignore[union-attr]
                            [(key, rows, WIDTH)],
                            known_agent=agent_name,
                            claims=[],
                        ),
                        secret,
                    )
                    for i in range(clients)
                ]
                sent = {}
                for sock, frame in zip(sockets, sealed, strict=True):
                    sent[sock] = time.perf_counter()
                    sock.send(frame)
                replies = {}
                pending = list(sockets)
                while pending:  # polls only the sockets still waiting (a poll is O(n))
                    ready = zmq.zmq_poll([(sock, zmq.POLLIN) for sock in pending], 5000)
                    arrived = time.perf_counter()
                    for sock, _ in ready:
                        replies[sock] = sock.recv()
                        samples.append(arrived - sent[sock])
                    pending = [sock for sock in pending if sock not in replies]
                for sock, frame in replies.items():
                    reply = open_frame(frame, (secret,))
                    assert isinstance(reply, Reply) and reply.results[0][1] == "ok"
                    release = Release(0, time.time(), [(reply.leases[0], [key])], read=False)
                    sock.send(seal(release, secret))
            client_cpu = time.thread_time() - client_cpu
            client_io = _zmq_io_cpu() - client_io
            ours.send("answers")
            p50, p99 = _percentiles(samples)
            busy, answered, batches, io_after = ours.recv()
            n = len(samples)
            # CPU per lookup (ms) of the four threads a lookup goes through, all on the
            # core the producer's engine leaves: the client's Python thread and its
            # ZeroMQ I/O thread, the server thread and the producer's I/O thread.
            cpu = [
                client_cpu / n,
                client_io / n,
                busy / max(answered, 1),
                (io_after - io_before) / n,
            ]
            rows_out.append(
                f"lookup x{clients:<2} step {step_s * 1e3:3.0f} ms"
                f"  p50 {p50:6.3f} p99 {p99:6.3f} ms"
                f"  CPU/lookup ms: client {cpu[0] * 1e3:.3f} io {cpu[1] * 1e3:.3f}"
                f" server {cpu[2] * 1e3:.3f} io {cpu[3] * 1e3:.3f}"
                f" (sum x{clients} = {sum(cpu) * clients * 1e3:.1f} ms);"
                f" batch p50 {statistics.median(batches):.0f} max {max(batches)}"
            )
            for sock in sockets:
                sock.close(0)
    context.term()
    ours.send("stop")
    ours.recv()
    proc.join(30)
    consumer.shutdown()
    agent.close()
    return rows_out


def table(repeats: int = 5) -> list[str]:
    """Run both transports, each in a fresh interpreter (UCX reads its settings once)."""
    lines = [
        "Table 5 - cross-engine fetch vs a raw NIXL READ of the same bytes (medians of "
        f"{repeats}), and lookup round trips while the producer's engine runs long steps",
        "                        ours                   raw READ            ours/raw",
    ]
    for label, env in (("same host (UCX default)", {}), ("UCX_TLS=tcp", {"UCX_TLS": "tcp"})):
        out = subprocess.run(
            [sys.executable, __file__, "--inner", "--repeats", str(repeats)],
            check=False,
            capture_output=True,
            text=True,
            env={**os.environ, **env},
        )
        if out.returncode != 0:
            # Its output was captured for the table's rows: without it, the operator
            # would see an exit status and not why.
            sys.stderr.write(out.stderr[-6000:])
            raise SystemExit(
                f"bench-p2p ({label}): the measuring process failed (exit {out.returncode}); "
                "the end of its stderr is above"
            )
        lines.append(f"-- {label}")
        lines.extend(line[2:] for line in out.stdout.splitlines() if line.startswith("| "))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.inner:
        print("\n".join(table(args.repeats)))
        return
    from ectools.tiny_blip2 import TinyBlip2, write_config_only

    # The regions on tmpfs, as by default (`ec_cpu_dir`), like the raw READ's buffers
    # in memory: on a disk file system (TMPDIR) they would be written back to disk.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="ec-bench-p2p-", dir=shm) as folder:
        base = Path(folder)
        model = str(write_config_only(base / "model", TinyBlip2(text_hidden=WIDTH)))
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        for line in _measure(model, base, f"127.0.0.1:{port}", args.repeats):
            print("| " + line, flush=True)


if __name__ == "__main__":
    main()
