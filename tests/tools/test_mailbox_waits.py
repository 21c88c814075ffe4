"""tools/bench/mailbox_waits.py: a served process's per-message events summed per actor and kind, largest waits first."""

from __future__ import annotations

import json

from tests.tools._bench_modules import load_bench

mailbox_waits = load_bench("mailbox_waits")


def _event(name: str, actor: str, kind: str, waited_s: float, took_s: float = 0.0) -> str:
    body = {"event": name, "actor": actor, "kind": kind, "time_in_mailbox": waited_s}
    if name == "mailbox.handled":
        body["duration"] = took_s
    return json.dumps(body)


def test_waits_and_handler_times_are_grouped_by_actor_and_kind() -> None:
    """Two gateway Generates (10 and 30 ms waiting, 1 and 3 ms handled) lead a batch wake; other lines are skipped."""
    lines = [
        "2026-12-06 a console line",
        _event("mailbox.received", "gateway", "gateway.generate", 0.010),
        _event("mailbox.handled", "gateway", "gateway.generate", 0.010, 0.001),
        _event("mailbox.received", "gateway", "gateway.generate", 0.030),
        _event("mailbox.handled", "gateway", "gateway.generate", 0.030, 0.003),
        _event("mailbox.received", "batch", "batch.wake", 0.002),
        json.dumps({"event": "http.request", "duration_ms": 4}),
        '{"event": "mailbox.received", "actor"',
    ]
    rows = mailbox_waits.summarize(lines)
    assert [(r["actor"], r["kind"]) for r in rows] == [("gateway", "gateway.generate"), ("batch", "batch.wake")]
    gen = rows[0]
    assert gen["received"] == 2
    assert gen["wait_max"] == 30.0
    assert gen["wait_sum"] == 40.0
    assert gen["handler_sum"] == 4.0
    assert gen["handler_max"] == 3.0
    assert rows[1]["received"] == 1
    assert rows[1]["handler_sum"] == 0.0
