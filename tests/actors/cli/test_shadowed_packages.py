"""The kvtier command stops with a clear message when another installed module hides one of kvtier's packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from actors.cli.main import shadowed_packages

REPO = Path(__file__).resolve().parents[3]


def test_kvtiers_own_packages_are_found_here() -> None:
    """In kvtier's own environment nothing hides its packages."""
    assert shadowed_packages() == []


def test_a_foreign_kernels_module_stops_the_command_with_its_path(tmp_path: Path) -> None:
    """A module named ``kernels`` earlier on the path (as Hugging Face's is in site-packages) makes ``kvtier`` exit 2 naming it, before any subcommand runs."""
    foreign = tmp_path / "site" / "kernels"
    foreign.mkdir(parents=True)
    (foreign / "__init__.py").write_text("raise RuntimeError('the foreign kernels module was imported')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]))
    done = subprocess.run(
        [sys.executable, "-c", "from actors.cli.main import main; raise SystemExit(main(['cache', '--help']))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "hides kvtier's own: kernels" in done.stderr
    assert str(foreign / "__init__.py") in done.stderr
    assert "foreign kernels module was imported" not in done.stderr
