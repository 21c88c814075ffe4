"""docs/rules.md's headline counts are generated from its tables and can never drift."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "rules_counts.py"
RULES = REPO / "docs" / "rules.md"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rules_counts", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rules_counts"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_rules_md_counts_are_current() -> None:
    """``tools/rules_counts.py --check`` passes on the committed docs/rules.md."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check", str(RULES)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr


def test_check_fails_when_a_status_changes_without_regenerating(tmp_path: Path) -> None:
    """Changing one row's status without rerunning the script makes ``--check`` fail."""
    text = RULES.read_text(encoding="utf-8")
    row = "| R1-1 | three tiers"
    assert row in text
    start = text.index(row)
    line = text[start:text.index("\n", start)]
    stale = text.replace(line, line.replace("| OK |", "| PART |", 1))
    copy = tmp_path / "rules.md"
    copy.write_text(stale, encoding="utf-8")
    mod = _module()
    assert mod.main(["--check", str(copy)]) == 1
    assert mod.main([str(copy)]) == 0  # regenerate
    assert mod.main(["--check", str(copy)]) == 0
    rows = mod.parse_rows(copy.read_text(encoding="utf-8"))
    assert sum(r.status == "PART" for r in rows) == sum(
        r.status == "PART" for r in mod.parse_rows(text)
    ) + 1


def test_an_unescaped_pipe_in_a_cell_is_refused_not_miscounted() -> None:
    """A row split by a bare ``|`` (R3-3's old text) is reported as malformed."""
    mod = _module()
    table = (
        "## §3\n\n| id | rule | status | where | proved by |\n|---|---|---|---|---|\n"
        "| R3-3 | `--kv-quant off|<bits>|config` | OK | x | y |\n"
    )
    with pytest.raises(mod.MalformedRules, match="7 cells"):
        mod.parse_rows(table)
    escaped = table.replace("off|<bits>|config", "off\\|<bits>\\|config")
    rows = mod.parse_rows(escaped)
    assert [(r.id, r.status) for r in rows] == [("R3-3", "OK")]
