"""Every script under tools/ starts: its ``--help`` runs as a subprocess and exits 0.

NOTE: ``--help`` exercises what breaks silently when the packages move or a
message is renamed (every module-level import, the argument parser) without
running a benchmark. ``make bench`` runs tools/bench/runtime.py, so that one
also runs a tiny measurement end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python <args>`` from the repository root and capture its output."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )


@pytest.fixture(scope="module")
def helps() -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """Every script's ``--help`` started at once, one per CPU (each mostly imports MLX)."""
    # NOTE: a script without an argument parser would ignore --help and run
    # for real (a benchmark, a kill loop); such a script is not started.
    runnable = [s for s in SCRIPTS if "ArgumentParser(" in (REPO / s).read_text(encoding="utf-8")]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        futures = {script: pool.submit(_run, script, "--help") for script in runnable}
        yield futures
        for future in futures.values():
            future.cancel()


def test_tools_are_found() -> None:
    """The discovery finds the scripts (an empty list would make the smoke test vacuous)."""
    assert "tools/bench/runtime.py" in SCRIPTS
    assert "tools/kill_loop.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs(
    script: str, helps: dict[str, Future[subprocess.CompletedProcess[str]]]
) -> None:
    """``python <script> --help`` imports the script and prints its usage with exit status 0."""
    assert script in helps, f"{script} has no argparse parser; give it one"
    done = helps[script].result(timeout=2 * _TIMEOUT_S)
    assert done.returncode == 0, f"{script} --help failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.startswith("usage:"), f"{script} --help printed:\n{done.stdout}"


def test_runtime_bench_tiny_run() -> None:
    """tools/bench/runtime.py (what ``make bench`` runs) measures tell and ask end to end."""
    done = _run("tools/bench/runtime.py", "--messages", "300", "--asks", "30", "--repeats", "1")
    assert done.returncode == 0, f"runtime bench failed:\n{done.stdout}\n{done.stderr}"
    for line in ("runtime, tracing filtered", "runtime, tracing on (JSON)",
                 "ratio tell filtered/raw:", "ask p50 runtime:"):
        assert line in done.stdout, f"missing {line!r} in:\n{done.stdout}"
