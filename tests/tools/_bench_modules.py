"""Load a tools/bench script as a module for the tests (tools/bench/ is run as scripts, not imported)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["BENCH", "REPO", "load_bench"]

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tools" / "bench"


def load_bench(name: str) -> ModuleType:
    """``tools/bench/<name>.py`` as the module ``bench_<name>``, loaded once per test session.

    Its folder goes on ``sys.path`` first, as when the script runs
    (``python tools/bench/<name>.py``), so its own ``from _common import ...``
    lines resolve.
    """
    module_name = f"bench_{name}"
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        return loaded
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # NOTE: registered before running it: its dataclasses look their module up.
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
