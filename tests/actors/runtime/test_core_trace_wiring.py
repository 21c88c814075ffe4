"""Every shell calls its core through ``ctx.traced``, so ``--record-trace`` misses no state change."""

from __future__ import annotations

import re
from pathlib import Path

ACTORS = Path(__file__).resolve().parents[3] / "actors"

# NOTE: a shell's state assignment from a core function: ``self.state, effects =
# core.handle(self.state, ...)``, ``keep.state, more = rc.stop(keep.state)``.
_CORE_CALL = re.compile(r"^\s*(?P<target>[\w.]*state), \w+ = (?P<call>[\w.]+)\((?P<arg>[\w.]*state)\b")


def untraced_core_calls(text: str) -> list[str]:
    """The lines of ``text`` that give a shell a core's new state without ``ctx.traced``."""
    return [line.strip() for line in text.splitlines()
            if (m := _CORE_CALL.match(line)) and m["call"] != "ctx.traced"]


def test_no_shell_calls_a_core_around_the_trace() -> None:
    """No shell under actors/ (cores and the runtime's CoreActor aside) assigns a core's state untraced."""
    found = []
    for path in sorted(ACTORS.rglob("*.py")):
        if path.parent.name == "runtime" or path.stem == "core" or path.stem.endswith("_core"):
            continue  # NOTE: a core calling its own helpers is inside the traced call
        found += [f"{path.relative_to(ACTORS.parent)}: {line}"
                  for line in untraced_core_calls(path.read_text(encoding="utf-8"))]
    assert found == []


def test_the_check_sees_an_untraced_call() -> None:
    """A direct ``core.handle`` (or a second entry point) is reported; the traced form is not."""
    text = (
        "        self.state, effects = core.handle(self.state, event)\n"
        "        keep.state, more = core.stop(keep.state)\n"
        "        self.state, effects = ctx.traced(core.handle, self.state, event)\n"
    )
    assert untraced_core_calls(text) == [
        "self.state, effects = core.handle(self.state, event)",
        "keep.state, more = core.stop(keep.state)",
    ]
