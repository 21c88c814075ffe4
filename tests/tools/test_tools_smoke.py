"""Every script under tools/ starts: its ``--help`` runs in a process of its own and exits 0.

NOTE: ``--help`` exercises what breaks silently when the packages move or a
message is renamed (every module-level import, the argument parser) without
running a benchmark. ``make bench`` runs tools/bench/runtime.py, so that one
also runs a tiny measurement end to end (a fresh interpreter).

NOTE: the scripts run as children forked from one parent that imported the
third-party libraries once (tests/tools/_help_runner.py): a fresh interpreter
a script spent ~3 s of its start importing MLX, mlx-lm and transformers, ~80
CPU-seconds for the 43 scripts, against ~20 this way. kvtier's own packages
and the script's own imports still load fresh in each child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"

# NOTE: ``_name.py`` files are helpers the scripts import (each import is
# exercised by the scripts' --help); everything else is a script people run.
SCRIPTS = sorted(
    p.relative_to(REPO).as_posix()
    for p in TOOLS.rglob("*.py")
    if not p.name.startswith("_") and "__pycache__" not in p.parts
)

_TIMEOUT_S = 60.0
RUNNER = Path(__file__).resolve().parent / "_help_runner.py"
_RUNNER_TIMEOUT_S = 110.0


def _run(*args: str, timeout: float = _TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``python <args>`` from the repository root and capture its output."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[int, str, str]]:
    """Every script's ``--help`` (exit status, stdout, stderr), one child per CPU at a time."""
    # NOTE: a script without an argument parser would ignore --help and run
    # for real (a benchmark, a kill loop); such a script is not started.
    runnable = [s for s in SCRIPTS if "ArgumentParser(" in (REPO / s).read_text(encoding="utf-8")]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "helps.json"
        done = _run(str(RUNNER), str(max(1, os.cpu_count() or 1)), str(out), *runnable,
                    timeout=_RUNNER_TIMEOUT_S)
        assert done.returncode == 0, f"the --help runner failed:\n{done.stdout}\n{done.stderr}"
        results = json.loads(out.read_text())
    return {script: (code, stdout, stderr) for script, (code, stdout, stderr) in results.items()}


def test_tools_are_found() -> None:
    """The discovery finds the scripts (an empty list would make the smoke test vacuous)."""
    assert "tools/bench/runtime.py" in SCRIPTS
    assert "tools/kill_loop.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs(script: str, helps: dict[str, tuple[int, str, str]]) -> None:
    """``<script> --help`` (as ``__main__``, its folder first on sys.path) imports the script and prints its usage with exit status 0."""
    assert script in helps, f"{script} has no argparse parser; give it one"
    code, stdout, stderr = helps[script]
    assert code == 0, f"{script} --help failed:\n{stdout}\n{stderr}"
    assert stdout.startswith("usage:"), f"{script} --help printed:\n{stdout}"


def test_runtime_bench_tiny_run() -> None:
    """tools/bench/runtime.py (what ``make bench`` runs) measures tell and ask end to end."""
    done = _run("tools/bench/runtime.py", "--messages", "300", "--asks", "30", "--repeats", "1")
    assert done.returncode == 0, f"runtime bench failed:\n{done.stdout}\n{done.stderr}"
    for line in ("runtime, tracing filtered", "runtime, tracing on (JSON)",
                 "ratio tell filtered/raw:", "ask p50 runtime:"):
        assert line in done.stdout, f"missing {line!r} in:\n{done.stdout}"
