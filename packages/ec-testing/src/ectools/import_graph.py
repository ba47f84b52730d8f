"""The static import graph of the workspace's product packages, for the import contracts.

Every module under `packages/*/src` (ec-testing's own `ectools` aside) is
parsed with `ast`, never imported. Each import statement becomes one `Import`
edge with its file and line, whether it runs only when a function is called
(`lazy`, with the function's qualified name) and whether it runs only under
`if TYPE_CHECKING:` (`typing_only`). Names resolve as Python resolves them:

- relative imports against the importing module's package;
- `from pkg import name` to the module `pkg.name` where that is a module;
- a name a module serves through `__getattr__ = lazy_exports(__name__, {...})`
  (`ec_core.lazy`) to the module it names, as an extra edge, since using
  the name imports that module;
- a module of ours also imports its parent packages (their `__init__` runs first);
- `torch.cuda` and `torch.npu` used as attributes of `torch` count as imports of
  those device modules (using them loads the device runtime).

Outside modules (vLLM, torch, zmq) are leaves named by their dotted path, with
the imported name appended for `from x import y` (`torch.cuda` for
`from torch import cuda`), so a rule can match them by prefix.

`ImportGraph.closure` is what a process that imports some roots loads
through our modules: the transitive closure over runtime edges (not
typing-only ones), with the chain of `file:line` edges that reaches each module.
Entry points declared in the packages' `pyproject.toml` are read by
`entry_points`, so a rule can name what vLLM or our own loader imports by name.
"""

from __future__ import annotations

import ast
import tomllib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ectools.checkout import ROOT

TEST_TOOLING = "ectools"
"""The import name of the workspace's test tooling (ec-testing), which is not a product."""
DEVICE_ATTRIBUTES = frozenset({"cuda", "npu"})
"""`torch.<name>`: torch's device modules."""


@dataclass(frozen=True)
class Source:
    """One module's text, where it lives, and whether it is a package's `__init__`."""

    path: Path
    text: str
    is_package: bool = False


@dataclass(frozen=True)
class Import:
    """One import edge: `importer` imports `target` at `path:line`."""

    importer: str
    target: str
    path: Path
    line: int
    function: str | None = None
    """The qualified name of the function the import runs in (None: at module level)."""
    typing_only: bool = False
    """Under `if TYPE_CHECKING:`: never executed."""
    via: str | None = None
    """For an edge to a lazily exported name's module: the module that exports it."""

    @property
    def lazy(self) -> bool:
        return self.function is not None

    def where(self) -> str:
        """`file:line`, the file relative to the repository root where it lies there."""
        try:
            shown = self.path.relative_to(ROOT)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}"

    def describe(self) -> str:
        how = f" (in {self.function})" if self.function else ""
        through = f" (the name {self.via} exports lazily)" if self.via else ""
        return f"{self.where()}: {self.importer} imports {self.target}{through}{how}"


def matches(name: str, prefixes: Iterable[str]) -> bool:
    """Whether dotted `name` is one of `prefixes` or inside one of them."""
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


@dataclass
class ImportGraph:
    """Modules by dotted name and each one's import edges (see the module docstring)."""

    sources: dict[str, Source]
    imports: dict[str, list[Import]] = field(default_factory=dict)

    @classmethod
    def from_sources(cls, sources: Mapping[str, Source]) -> ImportGraph:
        graph = cls(dict(sources))
        exports = {name: _lazy_exports(source.text) for name, source in graph.sources.items()}
        for name, source in graph.sources.items():
            graph.imports[name] = list(graph._edges(name, source, exports))
        return graph

    @classmethod
    def of_workspace(cls, root: Path = ROOT) -> ImportGraph:
        """Every product module under `root/packages/*/src`."""
        sources: dict[str, Source] = {}
        for src in sorted((root / "packages").glob("*/src")):
            for path in sorted(src.rglob("*.py")):
                parts = list(path.relative_to(src).with_suffix("").parts)
                is_package = parts[-1] == "__init__"
                if is_package:
                    parts.pop()
                if parts[0] == TEST_TOOLING:
                    continue
                sources[".".join(parts)] = Source(path, path.read_text(), is_package)
        return cls.from_sources(sources)

    def modules(self, *prefixes: str) -> list[str]:
        """Our modules under `prefixes` (all of them without prefixes), sorted."""
        return sorted(m for m in self.sources if not prefixes or matches(m, prefixes))

    def all_imports(self) -> Iterator[Import]:
        for name in sorted(self.imports):
            yield from self.imports[name]

    def closure(
        self, roots: Iterable[str], follow: Callable[[Import], bool] = lambda edge: True
    ) -> dict[str, list[Import]]:
        """Every module a process that imports `roots` loads, ours and outside ones, with
        the chain of runtime edges that first reaches it (empty for a root). Edges under
        TYPE_CHECKING are never followed; others only where `follow(edge)` is true."""
        chains: dict[str, list[Import]] = {}
        todo: deque[str] = deque()
        for root in roots:
            if root not in chains:
                chains[root] = []
                todo.append(root)
        while todo:
            module = todo.popleft()
            for edge in self.imports.get(module, []):
                if edge.typing_only or edge.target in chains or not follow(edge):
                    continue
                chains[edge.target] = [*chains[module], edge]
                todo.append(edge.target)
        return chains

    def _edges(
        self, name: str, source: Source, exports: Mapping[str, Mapping[str, str]]
    ) -> Iterator[Import]:
        parent = name.rpartition(".")[0]
        if parent:
            yield Import(name, parent, source.path, 1)
        package = name if source.is_package else parent
        for node, function, typing_only in _import_nodes(ast.parse(source.text)):

            def edge(
                target: str,
                via: str | None = None,
                at: tuple[ast.stmt, str | None, bool] = (node, function, typing_only),
            ) -> Import:
                return Import(name, target, source.path, at[0].lineno, at[1], at[2], via)

            if isinstance(node, ast.Expr):  # a `torch.<device>` use (see `_import_nodes`)
                yield edge(ast.unparse(node.value))
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield edge(alias.name)
                continue
            assert isinstance(node, ast.ImportFrom)
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            ours = base in self.sources
            if ours:
                yield edge(base)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in self.sources:
                    yield edge(full)
                elif not ours:
                    yield edge(full if alias.name != "*" else base)
                elif alias.name in exports.get(base, {}):
                    yield edge(exports[base][alias.name], via=f"{base}.{alias.name}")


def _import_nodes(tree: ast.Module) -> Iterator[tuple[ast.stmt, str | None, bool]]:
    """Every import statement, and every use of `torch.cuda` / `torch.npu` (as an
    `ast.Expr` holding the attribute, placed at its line), with the qualified name of
    the function it runs in and whether it sits under `if TYPE_CHECKING:`."""

    def walk(
        node: ast.AST, scope: list[str], function: str | None, typing_only: bool
    ) -> Iterator[tuple[ast.stmt, str | None, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, function, typing_only
            elif (
                isinstance(child, ast.Attribute)
                and isinstance(child.value, ast.Name)
                and child.value.id == "torch"
                and child.attr in DEVICE_ATTRIBUTES
            ):
                yield ast.Expr(child, lineno=child.lineno), function, typing_only
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = [*scope, child.name]
                yield from walk(child, inner, ".".join(inner), typing_only)
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, [*scope, child.name], function, typing_only)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for statement in child.body:
                    yield from walk(_Block(statement), scope, function, True)
                for statement in child.orelse:
                    yield from walk(_Block(statement), scope, function, typing_only)
            else:
                yield from walk(child, scope, function, typing_only)

    yield from walk(tree, [], None, False)


class _Block(ast.AST):
    """A one-statement node, so that `walk` sees the statement itself as a child."""

    _fields = ("body",)

    def __init__(self, statement: ast.stmt) -> None:
        super().__init__()
        self.body = [statement]


def _lazy_exports(text: str) -> dict[str, str]:
    """`{name: module}` for the names a module serves with `lazy_exports(__name__, ...)`.

    The mapping is a dict literal in the call, or a module-level name bound to one.
    """
    tree = ast.parse(text)
    literals: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    literals[target.id] = node.value
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "lazy_exports"
            and len(node.args) == 2
        ):
            continue
        mapping = node.args[1]
        if isinstance(mapping, ast.Name):
            mapping = literals.get(mapping.id, mapping)
        if not isinstance(mapping, ast.Dict):
            continue
        for key, value in zip(mapping.keys, mapping.values, strict=True):
            if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                found[str(key.value)] = str(value.value).partition(":")[0]
    return found


def entry_points(group: str, root: Path = ROOT) -> list[str]:
    """The modules the entry points of `group` that the packages declare name, sorted."""
    found: set[str] = set()
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        for value in project.get("entry-points", {}).get(group, {}).values():
            found.add(str(value).partition(":")[0])
    return sorted(found)
