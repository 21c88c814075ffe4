"""The cluster launcher's fairness and router settings: cores per replica, balance thresholds, SSD cleanup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.cluster.launch import Cluster, Replica, replica_cpus, router_command


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


def _sleeper(index: int, workdir: Path, ssd_dir: Path | None) -> Replica:
    # NOTE: a real child process standing in for kvtier serve (stop() signals and reaps it).
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    if ssd_dir is not None:
        (ssd_dir / "seg").mkdir(parents=True)
        (ssd_dir / "seg" / "blob").write_bytes(b"x" * 4096)
    return Replica(index, workdir, "off", "off", proc, ssd_dir=ssd_dir)


@pytest.mark.parametrize("keep", [True, False])
def test_stop_removes_only_the_ssd_directories_the_launcher_made_unless_kept(
        tmp_path: Path, keep: bool) -> None:
    """keep_ssd=False: stopping the cluster removes each exited replica's launcher-made SSD
    directory and counts its bytes; a caller's own --ssd-cache (ssd_dir None) and keep_ssd=True
    leave everything in place."""
    own = tmp_path / "mine"
    own.mkdir()
    (own / "blob").write_bytes(b"y" * 100)
    made = [tmp_path / "kv-0", tmp_path / "kv-1"]
    cluster = Cluster(3, tmp_path, keep_ssd=keep, replicas=[
        _sleeper(0, tmp_path, made[0]), _sleeper(1, tmp_path, made[1]), _sleeper(2, tmp_path, None)])
    codes = cluster.stop()
    assert all(code is not None for code in codes)
    assert [d.exists() for d in made] == [keep, keep]
    assert cluster.removed_ssd_bytes == (0 if keep else 2 * 4096)
    assert (own / "blob").read_bytes() == b"y" * 100
