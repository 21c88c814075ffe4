"""A short soak of a real ``kvtier serve``: mixed clients at once, nothing fails that should not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

_REPO = Path(__file__).resolve().parents[2]


def test_six_mixed_clients_for_a_minute_leave_no_violation_and_the_server_at_rest(
    tmp_path: Path,
) -> None:
    """Six clients mixing greedy, sampled multi-turn, cancelled, stalled, malformed, logprob and
    schema-constrained requests for 60 s (``tools/load/soak.py``): every greedy chat answers the
    same text each time, bad input gets a shaped 4xx, nothing else fails, /health answers
    throughout, and afterwards no row, stream, lease or queued request is left."""
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "tools/load/soak.py", "--clients", "6", "--seconds", "60",
         "--serve-arg=--prompt-cache", "--serve-arg=0.25", "--json", str(out)],
        cwd=_REPO, env=dict(os.environ), capture_output=True, text=True, timeout=500,
    )
    summary = json.loads(out.read_text())
    assert summary["violations"] == [], done.stdout[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = summary["outcomes"]
    for kind in ("greedy.ok", "agent.ok", "cancel.ok", "invalid.ok"):
        assert outcomes.get(kind, 0) > 0, outcomes
    # NOTE: answers compared: chats answered more than once.
    assert summary["greedy_repeats"] > 0
    assert outcomes["rest"] == 1
