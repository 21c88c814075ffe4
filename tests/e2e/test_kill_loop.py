"""End to end: kill -9 a real ``kvtier serve`` at random moments of write-behind and flush.

Fifty cycles of ``tools/kill_loop_cold.py`` (a tiny random-weight Llama, one
SSD directory for the run): each cycle restarts the server on what the kill
left and checks through the HTTP API that every prefix a flush acknowledged
durable before the kill is served from the SSD tier (``cached_tokens >=
prompt_tokens - 1``, one SSD hit per check) with the greedy answer of a
server without any cache, that no other prompt answers differently, and
that no startup found a corrupt file. The tool runs 1,000 cycles and more;
``docs/benchmarks.md`` has a result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tools.kill_loop_cold import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CYCLES = 50


@pytest.mark.timeout(3600)
def test_fifty_kills_lose_nothing_acknowledged_and_serve_nothing_corrupt(tmp_path: Path) -> None:
    """50 SIGKILLs (aimed in turn at any moment, a request, a flush, write-behind): 0 lost,
    0 corrupt, every acknowledged check served from disk, every kill hit a live server."""
    summary = run(CYCLES, tmp_path, seed=1, log=sys.stderr)
    print(summary.report())
    assert summary.failures == []
    assert (summary.lost, summary.corrupt, summary.not_from_disk) == (0, 0, 0)
    assert summary.cycles == CYCLES
    assert summary.corrupt_removed == 0
    # NOTE: every work phase opens with a flush before the kill can come.
    assert summary.flushes_durable >= CYCLES
    assert summary.flushes_not_durable == 0
    assert summary.acknowledged_checks >= CYCLES
    assert sum(summary.kills.values()) == CYCLES
