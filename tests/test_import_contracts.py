"""The process rules of the design, as import contracts over the product packages' sources.

Each contract is checked statically (`ectools.import_graph`: every module parsed
with `ast`, nothing imported) and reports every violation with its `file:line`
(for a rule over what a process loads, the whole chain of imports from the
process's roots). An exception is an `Allowed` entry naming the one import edge
it lets through and why; an entry that no longer matches any import fails too,
so the list never outlives its reason. The self-checks at the end run each
contract on a small synthetic package and require it to catch the violation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from ectools.import_graph import (
    TEST_TOOLING,
    Import,
    ImportGraph,
    Source,
    entry_points,
    matches,
)


@dataclass(frozen=True)
class Allowed:
    """One import edge a contract lets through: `importer` imports `target` (or a module
    inside it), in `function` (None: at module level)."""

    importer: str
    target: str
    function: str | None
    reason: str

    def covers(self, edge: Import) -> bool:
        return (
            edge.importer == self.importer
            and matches(edge.target, [self.target])
            and edge.function == self.function
        )


@dataclass
class Verdict:
    violations: list[str]
    used: set[Allowed]


Check = Callable[[ImportGraph, Sequence[Allowed]], Verdict]


def direct(
    importers: Callable[[ImportGraph], list[str]], forbidden: Callable[[str], bool]
) -> Check:
    """No module of `importers` imports a forbidden module itself (TYPE_CHECKING and
    function-level imports included: a layer's dependencies are all its imports)."""

    def check(graph: ImportGraph, allowed: Sequence[Allowed]) -> Verdict:
        verdict = Verdict([], set())
        for module in importers(graph):
            for edge in graph.imports[module]:
                if not forbidden(edge.target):
                    continue
                entry = next((a for a in allowed if a.covers(edge)), None)
                if entry is None:
                    verdict.violations.append(edge.describe())
                else:
                    verdict.used.add(entry)
        return verdict

    return check


def loads(roots: Callable[[ImportGraph], list[str]], forbidden: Callable[[str], bool]) -> Check:
    """A process that imports `roots` never loads a forbidden module through our modules
    (every runtime import followed, function-level ones included: they run in that
    process too; an allowed edge is not followed)."""

    def check(graph: ImportGraph, allowed: Sequence[Allowed]) -> Verdict:
        verdict = Verdict([], set())

        def follow(edge: Import) -> bool:
            entry = next((a for a in allowed if a.covers(edge)), None)
            if entry is not None:
                verdict.used.add(entry)
            return entry is None

        for module, chain in sorted(graph.closure(roots(graph), follow).items()):
            if forbidden(module) and chain:
                verdict.violations.append(
                    f"{chain[0].importer} loads {module}:\n"
                    + "\n".join(f"    {edge.describe()}" for edge in chain)
                )
        return verdict

    return check


def _top(name: str) -> str:
    return name.partition(".")[0]


def _is_backend(name: str) -> bool:
    return matches(name, ["ec_transfer_nixl"]) or _top(name).startswith("ec_worker_")


def _is_transport_library(name: str) -> bool:
    top = _top(name)
    return top in ("zmq", "msgspec", "nixl") or top.startswith("nixl_")


def _is_worker_or_device(name: str) -> bool:
    """A module the scheduler process must not load: the common worker, a backend's
    modules (its package `__init__`, the announcement the scheduler reads through the
    `ec_cpu_tier.backends` entry point, aside), the region's mapping, device runtimes."""
    if _top(name).startswith("ec_worker_") and "." in name:
        return True
    return matches(
        name,
        [
            "ec_core.worker_process",
            "ec_core.region.mapping",
            "torch.cuda",
            "torch.npu",
            "torch_npu",
        ],
    )


ENTRY_GROUPS_IN_SCHEDULER = (
    "vllm.general_plugins",
    "ec_cpu_tier.backends",
    "ec_cpu_tier.transports",
)
"""The entry points the scheduler process loads: vLLM's plugins (every process),
the backends' announcements (the shell picks one) and the transport (with peers)."""


def scheduler_process_roots(graph: ImportGraph) -> list[str]:
    """What the scheduler process imports of ours: every module of ec_scheduler (the
    connector shell runs there with the scheduler role), the allocator and policies, and
    what its entry points name."""
    named = [module for group in ENTRY_GROUPS_IN_SCHEDULER for module in entry_points(group)]
    return graph.modules("ec_scheduler", "ec_core.scheduler_process") + named


@dataclass(frozen=True)
class Contract:
    name: str
    check: Check
    allowed: tuple[Allowed, ...] = ()


CONTRACTS = (
    Contract(
        "ec_core imports neither the scheduler nor a backend",
        direct(
            lambda g: g.modules("ec_core"), lambda t: matches(t, ["ec_scheduler"]) or _is_backend(t)
        ),
    ),
    Contract(
        "the scheduler process loads no worker, mapping or device module",
        loads(scheduler_process_roots, _is_worker_or_device),
        (
            Allowed(
                "ec_scheduler.shell.connector",
                "ec_core.worker_process.worker",
                "ECCPUTierConnector._make_worker",
                "the shell builds its worker only with the worker role, in worker processes "
                "(the backend's worker class comes from `backends.load_worker_class`, there too)",
            ),
            Allowed(
                "ec_transfer_nixl.source",
                "ec_core.region.opening",
                None,
                "with cross-engine peers the NIXL source, which runs in the scheduler process, "
                "joins and maps this engine's region (`open_region`) to register it with its "
                "NIXL agent (`RegionAgent(base, nbytes)`): peers READ entries from those "
                "addresses and fetched entries are written there; NIXL needs the memory mapped "
                "in the process that runs the agent",
            ),
        ),
    ),
    Contract(
        "nixl, zmq and msgspec are imported only in ec_transfer_nixl",
        direct(
            lambda g: [m for m in g.modules() if not matches(m, ["ec_transfer_nixl"])],
            _is_transport_library,
        ),
        (
            Allowed(
                "ec_core.report_channel",
                "zmq",
                "_End.__init__",
                "the workers-to-scheduler report channel of one engine (not a transport between "
                "engines) is a ZeroMQ PUSH/PULL pair; pyzmq comes with vLLM itself, and it is "
                "imported only when a channel is built (an encode-only engine serving peers)",
            ),
        ),
    ),
    Contract(
        "no product package imports the test tooling (ectools)",
        direct(lambda g: g.modules(), lambda t: matches(t, [TEST_TOOLING])),
    ),
    Contract(
        "ec_core.settings (every process) loads nothing of ec_core.scheduler_process",
        loads(lambda g: ["ec_core.settings"], lambda t: matches(t, ["ec_core.scheduler_process"])),
    ),
    Contract(
        "the sizing tool (ec-cpu-sizing) loads neither vLLM nor torch: it runs anywhere",
        loads(lambda g: ["ec_scheduler.sizing"], lambda t: matches(t, ["vllm", "torch"])),
    ),
    Contract(
        "ec_core.layout loads nothing of ec_core.region.mapping",
        loads(lambda g: ["ec_core.layout"], lambda t: matches(t, ["ec_core.region.mapping"])),
    ),
)


@pytest.fixture(scope="module")
def workspace() -> ImportGraph:
    return ImportGraph.of_workspace()


@pytest.mark.parametrize("contract", CONTRACTS, ids=[c.name for c in CONTRACTS])
def test_contract_holds(contract: Contract, workspace: ImportGraph) -> None:
    verdict = contract.check(workspace, contract.allowed)
    stale = [a for a in contract.allowed if a not in verdict.used]
    report = [*verdict.violations]
    report += [
        f"stale exception (matches no import; remove it): {a.importer} -> {a.target}" for a in stale
    ]
    assert not report, f"{contract.name}:\n" + "\n".join(report)


def test_the_workspace_graph_sees_every_product_package(workspace: ImportGraph) -> None:
    tops = {module.split(".")[0] for module in workspace.modules()}
    root = Path(__file__).resolve().parents[1] / "packages"
    expected = {p.parent.name for p in root.glob("*/src/*/__init__.py")} - {TEST_TOOLING}
    assert tops == expected and "ec_scheduler.scheduler" in workspace.sources
    roots = scheduler_process_roots(workspace)
    assert {"ec_scheduler.shell.plugin", "ec_transfer_nixl", "ec_worker_cpu"} <= set(roots)


# ------------------------------------------------------------------ self-checks


def _graph(modules: dict[str, str]) -> ImportGraph:
    """A synthetic workspace: `{module: source}`; a name ending in `/` is a package."""
    sources = {}
    for name, text in modules.items():
        package = name.endswith("/")
        module = name.rstrip("/")
        path = (
            Path(*module.split("."), "__init__.py")
            if package
            else Path(*module.split(".")).with_suffix(".py")
        )
        sources[module] = Source(path, text, package)
    return ImportGraph.from_sources(sources)


PACKAGES = {"ec_core/": "", "ec_core.scheduler_process/": "", "ec_scheduler/": ""}


def _contract(name_start: str) -> Contract:
    return next(c for c in CONTRACTS if c.name.startswith(name_start))


def test_core_importing_the_scheduler_is_caught_with_its_line() -> None:
    graph = _graph({**PACKAGES, "ec_core.bad": "import os\n\nfrom ec_scheduler import remote\n"})
    verdict = _contract("ec_core imports").check(graph, ())
    assert verdict.violations == ["ec_core/bad.py:3: ec_core.bad imports ec_scheduler"]
    graph = _graph({**PACKAGES, "ec_core.bad": "def f():\n    import ec_worker_cuda.runtime\n"})
    (violation,) = _contract("ec_core imports").check(graph, ()).violations
    assert violation.startswith("ec_core/bad.py:2:") and "(in f)" in violation


def test_a_device_module_the_scheduler_loads_through_a_lazy_export_is_caught() -> None:
    graph = _graph(
        {
            **PACKAGES,
            "ec_core/": (
                "from ec_core.lazy import lazy_exports\n"
                '__getattr__ = lazy_exports(__name__, {"W": "ec_core.worker_process.worker:W"})\n'
            ),
            "ec_core.worker_process/": "",
            "ec_core.worker_process.worker": "class W: ...\n",
            "ec_scheduler.helper": "import torch\n\n\ndef sync():\n    torch.cuda.synchronize()\n",
            "ec_scheduler.top": (
                "def make():\n    from ec_core import W\n    from . import helper\n"
            ),
        }
    )
    violations = _contract("the scheduler process").check(graph, ()).violations
    assert any(
        v.startswith("ec_scheduler.top loads ec_core.worker_process.worker:")
        and "ec_scheduler/top.py:2: ec_scheduler.top imports ec_core.worker_process.worker "
        "(the name ec_core.W exports lazily) (in make)"
        in v
        for v in violations
    ), violations
    assert any("loads torch.cuda" in v and "ec_scheduler/helper.py:5:" in v for v in violations), (
        violations
    )
    # A backend's announcement is what the scheduler reads; its worker module is not.
    graph = _graph(
        {**PACKAGES, "ec_scheduler.x": "import ec_worker_cpu\nimport ec_worker_cpu.worker\n"}
    )
    (violation,) = _contract("the scheduler process").check(graph, ()).violations
    assert "loads ec_worker_cpu.worker" in violation


def test_typing_only_imports_are_not_loads() -> None:
    graph = _graph(
        {
            **PACKAGES,
            "ec_scheduler.x": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from ec_core.worker_process.worker import W\n"
            ),
        }
    )
    assert _contract("the scheduler process").check(graph, ()).violations == []


def test_an_exception_lets_through_only_its_own_edge() -> None:
    contract = _contract("nixl, zmq")
    graph = _graph(
        {
            **PACKAGES,
            "ec_core.report_channel": "class _End:\n    def __init__(self):\n        import zmq\n",
            "ec_core.other": "import msgspec\nfrom zmq import Context\n",
            "ec_transfer_nixl/": "import zmq, msgspec, nixl_cu12\n",
        }
    )
    verdict = contract.check(graph, contract.allowed)
    assert verdict.violations == [
        "ec_core/other.py:1: ec_core.other imports msgspec",
        "ec_core/other.py:2: ec_core.other imports zmq.Context",
    ]
    assert verdict.used == set(contract.allowed)


def test_test_tooling_in_a_product_is_caught() -> None:
    graph = _graph({**PACKAGES, "ec_scheduler.x": "from ectools.configs import make_vllm_config\n"})
    (violation,) = _contract("no product").check(graph, ()).violations
    assert violation.startswith("ec_scheduler/x.py:1:")


def test_settings_and_layout_rules_follow_imports_transitively() -> None:
    graph = _graph(
        {
            **PACKAGES,
            "ec_core.region/": "",
            "ec_core.region.mapping": "",
            "ec_core.sizes": "from ec_core.region.mapping import X\n",
            "ec_core.layout": "from ec_core import sizes\n",
            "ec_core.settings": "from .scheduler_process import policy\n",
            "ec_core.scheduler_process.policy": "",
        }
    )
    (layout,) = _contract("ec_core.layout").check(graph, ()).violations
    assert "ec_core/sizes.py:1: ec_core.sizes imports ec_core.region.mapping" in layout
    settings = _contract("ec_core.settings").check(graph, ()).violations
    assert any("ec_core/settings.py:1:" in v for v in settings), settings
