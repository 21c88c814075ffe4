"""The cluster launcher's fairness and router settings: cores per replica, balance thresholds."""

from __future__ import annotations

import pytest

from tools.cluster.launch import replica_cpus, router_command


def test_replicas_get_equal_shares_of_the_cores() -> None:
    """With enough cores each replica gets its own; with fewer, replicas share cores in turn."""
    assert [replica_cpus(i, 2, [0, 1]) for i in range(2)] == [{0}, {1}]
    assert [replica_cpus(i, 2, [0, 1, 2, 3]) for i in range(2)] == [{0, 1}, {2, 3}]
    assert [replica_cpus(i, 4, [0, 1]) for i in range(4)] == [{0}, {1}, {0}, {1}]
    with pytest.raises(ValueError, match="no cores"):
        replica_cpus(0, 1, [])


def _flags(cmd: list[str]) -> dict[str, str]:
    return {cmd[k]: cmd[k + 1] for k in range(len(cmd) - 1)
            if cmd[k].startswith("--balance-")}


def test_cache_aware_and_the_event_router_get_the_same_balance_thresholds() -> None:
    """The same (abs, rel) reaches sglang-router's cache_aware and the event router; round-robin,
    which has no such rule, gets none; unset, neither gets a flag (each keeps its default)."""
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    events = [("tcp://127.0.0.1:3", "tcp://127.0.0.1:4"), ("tcp://127.0.0.1:5", "tcp://127.0.0.1:6")]
    want = {"--balance-abs-threshold": "2", "--balance-rel-threshold": "1.5"}
    for policy in ("cache_aware", "events"):
        cmd = router_command(policy, urls, events, host="127.0.0.1", port=7, balance=(2, 1.5))
        assert _flags(cmd) == want
        assert _flags(router_command(policy, urls, events, host="127.0.0.1", port=7)) == {}
    rr = router_command("round_robin", urls, events, host="127.0.0.1", port=7, balance=(2, 1.5))
    assert _flags(rr) == {}
    ev = router_command("events", urls, events, host="127.0.0.1", port=7)
    assert ev.count("--replica") == 2
    assert "http://127.0.0.1:2,tcp://127.0.0.1:5,tcp://127.0.0.1:6" in ev
