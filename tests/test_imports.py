"""The import rules of docs/architecture.md, read from the source with ``ast``.

- no import cycle among the modules of ``actors/`` and ``kernels/`` (imports
  that run: module level and inside functions; ``if TYPE_CHECKING:`` blocks
  never run and are left out of the cycle check only);
- imports point down: ``kernels`` and ``messages`` import no ``actors``,
  ``messages`` imports no ``kernels``;
- an actor package imports another actor package only through its public
  modules, and only ``actors/engine`` imports ``actors/engine/wiring.py``;
- actors are spawned (``.spawn(``) only in ``actors/engine/wiring.py``;
- the environment is read (``os.environ``, ``os.getenv``) only by
  ``EngineConfig`` (``actors/engine/config.py``) and ``kernels/_env.py``.

Each rule is checked on the repository and, on a small tree written to
``tmp_path``, shown to catch the violation it names.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("actors", "kernels", "messages")
WIRING = "actors.engine.wiring"
ENV_READERS = ("actors.engine.config", "kernels._env")


@dataclass(frozen=True, slots=True)
class Import:
    """One imported module as seen from ``source`` (line ``line``)."""

    source: str
    target: str
    line: int
    type_only: bool


@dataclass(frozen=True)
class Tree:
    """The modules under ``root``'s top packages: dotted name -> file."""

    root: Path
    modules: dict[str, Path]

    @classmethod
    def read(cls, root: Path) -> Tree:
        """Every ``.py`` file under ``root/{actors,kernels,messages}``."""
        modules: dict[str, Path] = {}
        for top in TOPS:
            for path in sorted((root / top).rglob("*.py")):
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join(parts)] = path
        return cls(root, modules)

    def known(self, name: str) -> str | None:
        """``name`` or its nearest enclosing module of this tree (``None``: outside the tree)."""
        while name not in self.modules:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    @functools.cached_property
    def edges(self) -> tuple[Import, ...]:
        """Every import of a module of this tree by a module of this tree."""
        return tuple(self._imports())

    def imports(self) -> tuple[Import, ...]:
        """Every import of a module of this tree by a module of this tree (computed once)."""
        return self.edges

    def _imports(self) -> Iterator[Import]:
        for name, path in self.modules.items():
            tree = _parse(path)
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            for node, type_only in _import_nodes(tree.body, type_only=False):
                for target in self._targets(node, package):
                    found = self.known(target)
                    if found is not None and found != name:
                        yield Import(name, found, node.lineno, type_only)

    def _targets(self, node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        # NOTE: ``from pkg import name`` imports the submodule pkg.name when
        # there is one, else a name of pkg's ``__init__``.
        return [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in self.modules else base
            for alias in node.names
        ]


@functools.cache
def _parse(path: Path) -> ast.Module:
    """The file's syntax tree (parsed once per test run: the rules share it)."""
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    body: list[ast.stmt], *, type_only: bool
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, at any depth, and whether only a type checker runs it."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt, type_only
        elif isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            yield from _import_nodes(stmt.body, type_only=True)
            yield from _import_nodes(stmt.orelse, type_only=type_only)
        else:
            for node in ast.walk(stmt):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield node, type_only


def _package(module: str) -> str:
    """The actor package (``actors.gateway``), or the top-level module (``actors.errors``)."""
    return ".".join(module.split(".")[:2])


# --- the rules: each returns its violations, one line each ---------------------------


def cycles(tree: Tree) -> list[str]:
    """Import cycles among ``actors`` and ``kernels`` modules (imports that run)."""
    graph: dict[str, set[str]] = {name: set() for name in tree.modules}
    for imp in tree.imports():
        if not imp.type_only and imp.source.startswith(("actors", "kernels")):
            graph[imp.source].add(imp.target)
    found: list[str] = []
    for component in _strongly_connected(graph):
        if len(component) > 1:
            found.append(" <-> ".join(sorted(component)))
    return found


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (module graphs are deep enough for recursion limits)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(component)
    return out


def upward(tree: Tree) -> list[str]:
    """``kernels``/``messages`` importing ``actors``; ``messages`` importing ``kernels``."""
    found = []
    for imp in tree.imports():
        low = imp.source.split(".")[0]
        high = imp.target.split(".")[0]
        if (low in ("kernels", "messages") and high == "actors") or (
            low == "messages" and high == "kernels"
        ):
            found.append(f"{imp.source}:{imp.line} imports {imp.target}")
    return found


def reaching_in(tree: Tree) -> list[str]:
    """An actor module importing another actor package's private module, or the engine's wiring."""
    found = []
    for imp in tree.imports():
        if not (imp.source.startswith("actors.") and imp.target.startswith("actors.")):
            continue
        if _package(imp.source) == _package(imp.target):
            continue
        private = any(part.startswith("_") for part in imp.target.split(".")[2:])
        if private or imp.target == WIRING:
            found.append(f"{imp.source}:{imp.line} imports {imp.target}")
    return found


def spawns(tree: Tree) -> list[str]:
    """``.spawn(`` calls outside ``actors/engine/wiring.py``."""
    found = []
    for name, path in tree.modules.items():
        if name == WIRING:
            continue
        for node in ast.walk(_parse(path)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "spawn"
            ):
                found.append(f"{name}:{node.lineno} calls {ast.unparse(node.func)}(...)")
    return found


def environment_reads(tree: Tree) -> list[str]:
    """``os.environ`` / ``os.getenv`` / ``os.putenv`` outside the two modules that read the environment."""
    found = []
    for name, path in tree.modules.items():
        if name in ENV_READERS:
            continue
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                found.append(f"{name}:{node.lineno} reads os.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                for alias in node.names:
                    if alias.name in ("environ", "getenv", "environb"):
                        found.append(f"{name}:{node.lineno} imports os.{alias.name}")
    return found


# --- the repository ------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo() -> Tree:
    return Tree.read(ROOT)


def test_the_walk_sees_the_packages_and_their_imports(repo: Tree) -> None:
    """The walk finds the packages and resolves absolute, relative and submodule imports."""
    edges = {(imp.source, imp.target) for imp in repo.imports()}
    assert ("actors.gateway", "actors.gateway.actor") in edges  # from .actor import ...
    assert ("actors.engine.startup", "actors.engine_thread.memory_guard") in edges
    assert ("actors.gateway.runner", "actors.engine_thread.steps") in edges
    assert len(repo.modules) > 100


def test_no_import_cycle_in_actors_or_kernels(repo: Tree) -> None:
    """No module of actors/ or kernels/ reaches itself through imports that run."""
    assert cycles(repo) == []


def test_imports_point_down(repo: Tree) -> None:
    """kernels and messages import no actors; messages import no kernels."""
    assert upward(repo) == []


def test_actor_packages_meet_only_through_public_modules(repo: Tree) -> None:
    """No actor module imports another actor package's private module or actors/engine/wiring.py."""
    assert reaching_in(repo) == []


def test_actors_are_spawned_only_by_the_wiring(repo: Tree) -> None:
    """``.spawn(`` appears only in actors/engine/wiring.py."""
    assert spawns(repo) == []


def test_the_environment_is_read_only_by_the_config_and_kernels_env(repo: Tree) -> None:
    """No module but EngineConfig's and kernels/_env.py reads os.environ or os.getenv."""
    assert environment_reads(repo) == []


# --- each rule catches what it names ---------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Tree:
    for top in TOPS:
        (root / top).mkdir(parents=True, exist_ok=True)
        (root / top / "__init__.py").touch()
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return Tree.read(root)


def test_a_cycle_through_a_package_init_and_a_function_level_import_is_found(
    tmp_path: Path,
) -> None:
    """a -> b (relative, in __init__) -> c (inside a function) -> a is one cycle; type-only is not."""
    tree = _write(
        tmp_path,
        {
            "actors/a/__init__.py": "from .b import x\n",
            "actors/a/b.py": "def f():\n    from actors.c import y\n",
            "actors/c.py": "from actors.a import z\n",
            "kernels/p.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kernels.q import t\n",
            "kernels/q.py": "import kernels.p\n",
        },
    )
    assert cycles(tree) == ["actors.a <-> actors.a.b <-> actors.c"]


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    """kernels importing actors and messages importing kernels are both reported."""
    tree = _write(
        tmp_path,
        {
            "actors/x.py": "",
            "kernels/k.py": "from actors import x\n",
            "messages/m.py": "import kernels.k\n",
        },
    )
    assert upward(tree) == [
        "kernels.k:1 imports actors.x",
        "messages.m:1 imports kernels.k",
    ]


def test_reaching_into_another_actor_package_is_found(tmp_path: Path) -> None:
    """A private module of another actor package, and the engine's wiring, even type-only."""
    tree = _write(
        tmp_path,
        {
            "actors/engine/__init__.py": "",
            "actors/engine/wiring.py": "from actors.engine import api\n",
            "actors/engine/api.py": "from . import wiring\n",
            "actors/http/__init__.py": "from ._errors import E\n",
            "actors/http/_errors.py": "",
            "actors/cli/__init__.py": "",
            "actors/cli/serve.py": (
                "from typing import TYPE_CHECKING\nfrom actors.http._errors import E\n"
                "if TYPE_CHECKING:\n    from actors.engine.wiring import Parts\n"
            ),
        },
    )
    assert reaching_in(tree) == [
        "actors.cli.serve:2 imports actors.http._errors",
        "actors.cli.serve:4 imports actors.engine.wiring",
    ]


def test_a_spawn_outside_the_wiring_is_found(tmp_path: Path) -> None:
    """``system.spawn(...)`` in an actor package is reported; the wiring's is not."""
    tree = _write(
        tmp_path,
        {
            "actors/engine/__init__.py": "",
            "actors/engine/wiring.py": "def go(system):\n    system.spawn('a', f)\n",
            "actors/queue/__init__.py": "",
            "actors/queue/actor.py": "def go(system):\n    return system.spawn('q', f)\n",
        },
    )
    assert spawns(tree) == ["actors.queue.actor:2 calls system.spawn(...)"]


def test_an_environment_read_outside_the_two_readers_is_found(tmp_path: Path) -> None:
    """os.environ.get and ``from os import getenv`` are reported; kernels/_env.py's are not."""
    tree = _write(
        tmp_path,
        {
            "kernels/_env.py": "import os\nX = os.environ.get('A')\n",
            "kernels/k.py": "import os\nX = os.environ.get('A')\n",
            "actors/a.py": "from os import getenv\n",
        },
    )
    assert environment_reads(tree) == [
        "actors.a:1 imports os.getenv",
        "kernels.k:2 reads os.environ",
    ]
