"""The sans-IO convention of docs/architecture.md, read from the source.

- every core (``actors/<pkg>/core.py``, ``actors/<pkg>/*_core.py``) has one
  entry point, ``handle(state, event)``: exactly two positional parameters,
  so time (and every other input) travels in the event;
- a shell calls its core's state-changing functions only as ``handle``, and
  ``ctx.traced`` only as ``ctx.traced(<core>.handle, state, event)``: no
  second entry point (``stop``, ``tick``), no time passed beside the event;
- a shell matches its core's effects with ``match`` + ``assert_never``, never
  with an ``isinstance`` chain over two or more of the core's effect types.

A core function "changes state" when its return annotation names ``Effect``
(what ``handle`` returns); queries (``stats``, ``next_wake``) and
constructors (``new_state``) stay callable. Each rule is also shown to catch
the violation it names on a small source text.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
ACTORS = ROOT / "actors"


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _is_core(path: Path) -> bool:
    return path.stem == "core" or path.stem.endswith("_core")


def core_modules() -> dict[str, ModuleType]:
    """Every actor core under actors/ (the runtime aside), imported, by dotted name."""
    found = {}
    for path in sorted(ACTORS.rglob("*.py")):
        if _is_core(path) and "runtime" not in path.parts:
            name = _dotted(path)
            found[name] = importlib.import_module(name)
    return found


def handle_problems(module: ModuleType) -> list[str]:
    """What is wrong with ``module.handle``'s shape (empty: one entry point of two parameters)."""
    handle = getattr(module, "handle", None)
    if not inspect.isfunction(handle):
        return [f"{module.__name__}: no handle function"]
    params = list(inspect.signature(handle).parameters.values())
    positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty]
    if len(params) != 2 or len(positional) != 2:
        shown = ", ".join(p.name for p in params)
        return [f"{module.__name__}: handle({shown}) is not handle(state, event)"]
    if "Effect" not in str(inspect.signature(handle).return_annotation):
        return [f"{module.__name__}: handle does not return the core's effects"]
    return []


@dataclass(frozen=True, slots=True)
class _Core:
    """What a shell may call of a core: its entry points besides handle, and its effect types."""

    other_entry_points: frozenset[str]
    effects: frozenset[str]


def _describe(module: ModuleType) -> _Core:
    entry = set()
    for name, obj in vars(module).items():
        if (inspect.isfunction(obj) and obj.__module__ == module.__name__ and name != "handle"
                and "Effect" in str(inspect.signature(obj).return_annotation)):
            entry.add(name)
    effect = getattr(module, "Effect", None)
    members = typing.get_args(effect) or ((effect,) if isinstance(effect, type) else ())
    return _Core(frozenset(entry), frozenset(m.__name__ for m in members))


def _core_imports(
    tree: ast.Module, module: str, cores: dict[str, _Core]
) -> tuple[dict[str, _Core], dict[str, tuple[_Core, str]]]:
    """Names bound to a core module (``from . import core``), and names imported from one."""
    modules: dict[str, _Core] = {}
    names: dict[str, tuple[_Core, str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = module.split(".")[: -node.level]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            bound = alias.asname or alias.name
            if f"{source}.{alias.name}" in cores:
                modules[bound] = cores[f"{source}.{alias.name}"]
            elif source in cores:
                names[bound] = (cores[source], alias.name)
    return modules, names


def _isinstance_effects(test: ast.expr, modules: dict[str, _Core]) -> int:
    """How many of a core's effect types ``isinstance(x, <core>.T)`` (or a tuple of them) tests."""
    if not (isinstance(test, ast.Call) and isinstance(test.func, ast.Name)
            and test.func.id == "isinstance" and len(test.args) == 2):
        return 0
    kinds = test.args[1].elts if isinstance(test.args[1], ast.Tuple) else [test.args[1]]
    return sum(
        1 for kind in kinds
        if isinstance(kind, ast.Attribute) and isinstance(kind.value, ast.Name)
        and kind.value.id in modules and kind.attr in modules[kind.value.id].effects
    )


def _chain_tests(node: ast.If) -> list[ast.expr]:
    tests = [node.test]
    while len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
        node = node.orelse[0]
        tests.append(node.test)
    return tests


def _is_handle(expr: ast.expr) -> bool:
    return (isinstance(expr, ast.Attribute) and expr.attr == "handle") or (
        isinstance(expr, ast.Name) and expr.id == "handle"
    )


def shell_problems(text: str, module: str, cores: dict[str, _Core]) -> list[str]:
    """The places in ``text`` (the source of ``module``) where a shell breaks the convention."""
    tree = ast.parse(text)
    modules, names = _core_imports(tree, module, cores)
    found: list[str] = []
    for alias, (core, name) in names.items():
        if name in core.other_entry_points:
            found.append(f"{module}: imports the core's entry point {name!r} ({alias})")
    elifs = {id(n.orelse[0]) for n in ast.walk(tree)
             if isinstance(n, ast.If) and len(n.orelse) == 1 and isinstance(n.orelse[0], ast.If)}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr in modules[node.value.id].other_entry_points):
            found.append(f"{module}:{line}: calls {node.value.id}.{node.attr} (only handle)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "traced":
            if len(node.args) != 3 or node.keywords or not _is_handle(node.args[0]) \
                    or any(isinstance(a, ast.Starred) for a in node.args):
                found.append(f"{module}:{line}: {ast.unparse(node)} is not traced(handle, state, event)")
        elif (isinstance(node, ast.If) and id(node) not in elifs
              and sum(_isinstance_effects(t, modules) for t in _chain_tests(node)) >= 2):
            found.append(f"{module}:{line}: effects matched with an isinstance chain")
    uses_handle = any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                      and n.value.id in modules and n.attr == "handle" for n in ast.walk(tree))
    if uses_handle and not any(
        isinstance(n, ast.match_case) and isinstance(n.pattern, ast.MatchAs)
        and n.pattern.pattern is None and "assert_never" in ast.unparse(n)
        for n in ast.walk(tree)
    ):
        found.append(f"{module}: runs its core but has no `case _: assert_never(...)`")
    return sorted(found)


@pytest.fixture(scope="module")
def cores() -> dict[str, ModuleType]:
    """The actor cores, imported."""
    found = core_modules()
    assert len(found) >= 12, sorted(found)  # NOTE: the rglob must not silently find nothing
    return found


def test_every_core_has_one_entry_point_handle_state_event(cores: dict[str, ModuleType]) -> None:
    """Each actor core's ``handle`` takes exactly (state, event) and returns its effects."""
    assert [problem for module in cores.values() for problem in handle_problems(module)] == []


def test_every_shell_calls_only_handle_traced_and_matches_effects(cores: dict[str, ModuleType]) -> None:
    """No module under actors/ calls a second core entry point, traces anything but
    ``handle(state, event)``, or dispatches effects with an isinstance chain."""
    described = {name: _describe(module) for name, module in cores.items()}
    found = []
    for path in sorted(ACTORS.rglob("*.py")):
        if _is_core(path) or "runtime" in path.parts:
            continue
        found += shell_problems(path.read_text(encoding="utf-8"), _dotted(path), described)
    assert found == []


_FakeEffect = int
"""Stands for a core's ``Effect`` in the annotations below."""


def _two_parameters(state: int, event: int) -> tuple[int, list[_FakeEffect]]:
    return state, [event]


def _time_beside(state: int, event: int, now: float = 0.0) -> tuple[int, list[_FakeEffect]]:
    return state, [event]


def test_the_handle_check_sees_a_time_argument_and_a_missing_handle() -> None:
    """A ``handle(state, event, now)`` and a core without ``handle`` are reported; the right shape is not."""
    good = ModuleType("good")
    bad = ModuleType("bad")
    empty = ModuleType("empty")
    setattr(good, "handle", _two_parameters)  # noqa: B010 - a module built for the test
    setattr(bad, "handle", _time_beside)  # noqa: B010
    assert handle_problems(good) == []
    assert handle_problems(bad) == [
        "bad: handle(state, event, now) is not handle(state, event)"
    ]
    assert handle_problems(empty) == ["empty: no handle function"]


def test_the_shell_check_sees_each_violation() -> None:
    """A second entry point (called or imported), a traced call with time beside the event,
    an isinstance chain over effects and a missing ``assert_never`` are each reported."""
    cores = {"actors.x.core": _Core(frozenset({"stop"}), frozenset({"Send", "Answer"}))}
    good = (
        "from . import core\n"
        "def receive(self, ctx, envelope):\n"
        "    self.state, effects = ctx.traced(core.handle, self.state, envelope)\n"
        "    for effect in effects:\n"
        "        match effect:\n"
        "            case core.Send(): pass\n"
        "            case _: assert_never(effect)\n"
        "    if isinstance(effect, core.Send): pass\n"
        "    elif isinstance(effect, core.Stopping): pass\n"
    )
    assert shell_problems(good, "actors.x.actor", cores) == []
    bad = (
        "from . import core as c\n"
        "from .core import stop\n"
        "def receive(self, ctx, envelope):\n"
        "    self.state, effects = ctx.traced(c.stop, self.state)\n"
        "    self.state, effects = ctx.traced(c.handle, self.state, envelope, ctx.clock.now())\n"
        "    for effect in effects:\n"
        "        if isinstance(effect, c.Send): pass\n"
        "        elif isinstance(effect, c.Answer): pass\n"
    )
    assert shell_problems(bad, "actors.x.actor", cores) == [
        "actors.x.actor: imports the core's entry point 'stop' (stop)",
        "actors.x.actor: runs its core but has no `case _: assert_never(...)`",
        "actors.x.actor:4: calls c.stop (only handle)",
        "actors.x.actor:4: ctx.traced(c.stop, self.state) is not traced(handle, state, event)",
        ("actors.x.actor:5: ctx.traced(c.handle, self.state, envelope, ctx.clock.now()) "
         "is not traced(handle, state, event)"),
        "actors.x.actor:7: effects matched with an isinstance chain",
    ]
