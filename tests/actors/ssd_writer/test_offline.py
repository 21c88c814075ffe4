"""``kvtier cache``: listing and purging the SSD tier's real files, durably, never under a running server.

Entries are written by the real tier (tiny model, real codec, real temp
directories); the command runs through ``actors.cli.main``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest

from actors.cli import cache as cache_cli
from actors.cli import main as cli_main
from actors.engine.wiring import spawn_ssd_writer
from actors.runtime import ActorSystem
from actors.ssd_writer import EngineTensorSource, namespace_dir, purge_tier
from kernels import CacheRegistry, EngineThread, UntrustedPath
from messages import SsdStats, SsdStatsRequest, StoreResult
from tests.actors.ssd_writer.support import (
    ASK,
    IDENTITY,
    ForwardingPort,
    ThreadTurns,
    config,
    files,
    register,
    store_body,
)

OLD = "kvtold0000000000000000"


class RecordingPort(ForwardingPort):
    """Records unlinks and directory fsyncs in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def _before(self, method: str, *args: Any) -> None:
        if method in ("unlink", "fsync_dir"):
            self.calls.append((method, str(args[0])))


async def store_entries(root: Path, engine: EngineThread, model: Any, prompts: list[tuple[int, ...]]) -> None:
    """Write one entry per prompt through the real tier under IDENTITY's fingerprint."""
    registry = CacheRegistry()
    regs = [await register(engine, registry, model, p) for p in prompts]
    async with ActorSystem() as system:
        spawn_ssd_writer(
            system,
            config=config(root),
            source=EngineTensorSource(ThreadTurns(engine), registry, IDENTITY),
        )
        for reg, p in zip(regs, prompts, strict=True):
            res = await system.ask("ssd_writer", store_body(reg, p), timeout=ASK, expect=StoreResult)
            assert res.stored
    for reg in regs:
        registry.dispose(reg.handle)


def old_fingerprint_dir(root: Path) -> list[Path]:
    """A second fingerprint directory holding two entry files and a temp file (as an older kvtier left them)."""
    ns = root / OLD / namespace_dir("")
    ns.mkdir(parents=True, mode=0o700)
    (root / OLD).chmod(0o700)
    made = []
    for name, size in (("a.kvt", 1000), ("b.kvt", 3000), ("c.kvt.tmp", 500)):
        (ns / name).write_bytes(b"\0" * size)
        made.append(ns / name)
    return made


@pytest.fixture
async def tier(tmp_path: Path, engine: EngineThread, model: Any) -> Path:
    """A private tier root with two entries under IDENTITY's fingerprint and an old fingerprint directory."""
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    await store_entries(root, engine, model, [(1, 2, 3, 4), (5, 6, 7, 8)])
    old_fingerprint_dir(root)
    return root


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    """Run ``kvtier cache ... --json``; the exit code and the parsed output."""
    code = cli_main(["cache", *argv, "--json"])
    # NOTE: the command's JSON is its one line of output; a running tier's log lines may precede it.
    lines = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(lines[-1]) if lines else None


def disk(root: Path) -> dict[str, tuple[int, int]]:
    """Per fingerprint directory: (files, bytes) of what is really on disk."""
    out = {}
    for fp in sorted(p for p in root.iterdir() if p.is_dir()):
        sizes = [f.stat().st_size for f in fp.rglob("*.kvt*") if f.is_file()]
        out[fp.name] = (len(sizes), sum(sizes))
    return out


@pytest.mark.anyio
async def test_list_reports_every_fingerprint_directory_with_its_files_and_bytes(
    tier: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Entries, temp files and bytes per directory and in total match the files on disk."""
    code, listed = run_json(capsys, "list", "--ssd-cache", str(tier))
    assert code == 0
    on_disk = disk(tier)
    got = {f["name"]: (f["entries"] + f["other_files"], f["total_bytes"]) for f in listed["fingerprints"]}
    assert got == on_disk
    assert listed["total_bytes"] == sum(b for _, b in on_disk.values())
    old = next(f for f in listed["fingerprints"] if f["name"] == OLD)
    assert (old["entries"], old["entry_bytes"], old["other_files"]) == (2, 4000, 1)
    assert next(f for f in listed["fingerprints"] if f["name"] == IDENTITY.fingerprint)["entries"] == 2


@pytest.mark.anyio
async def test_purge_stale_fingerprints_keeps_the_current_one_and_the_tier_still_restores(
    tier: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    engine: EngineThread, model: Any,
) -> None:
    """Every directory but the current one goes (lock file and all); the current entries stay indexed."""
    monkeypatch.setattr(cache_cli, "current_fingerprint", lambda model, kv_quant: IDENTITY.fingerprint)
    code, report = run_json(capsys, "purge", "--stale-fingerprints", "--ssd-cache", str(tier))
    assert code == 0
    assert report["removed_dirs"] == [str(tier / OLD)]
    assert (report["removed_files"], report["removed_bytes"]) == (3, 4500)
    assert not (tier / OLD).exists()
    assert disk(tier)[IDENTITY.fingerprint][0] == 2
    async with ActorSystem() as system:
        spawn_ssd_writer(
            system, config=config(tier),
            source=EngineTensorSource(ThreadTurns(engine), CacheRegistry(), IDENTITY),
        )
        stats = await system.ask("ssd_writer", SsdStatsRequest(), timeout=ASK, expect=SsdStats)
        assert stats.entries == 2
        assert stats.evicted == 0


@pytest.mark.anyio
async def test_purge_all_removes_every_file_and_directory(tier: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--all leaves an empty root: no entry, temp file, lock file or directory."""
    code, report = run_json(capsys, "purge", "--all", "--ssd-cache", str(tier))
    assert code == 0
    assert report["removed_files"] == 5
    assert sorted(report["removed_dirs"]) == sorted([str(tier / OLD), str(tier / IDENTITY.fingerprint)])
    assert disk(tier) == {}
    assert not any(os.scandir(tier))


@pytest.mark.anyio
async def test_purge_refuses_a_directory_a_running_server_holds(
    tier: Path, capsys: pytest.CaptureFixture[str], engine: EngineThread
) -> None:
    """With the tier running on IDENTITY's directory, --all leaves it untouched, reports it, exits 1."""
    before = files(tier / IDENTITY.fingerprint, ".kvt")
    async with ActorSystem() as system:
        spawn_ssd_writer(
            system, config=config(tier),
            source=EngineTensorSource(ThreadTurns(engine), CacheRegistry(), IDENTITY),
        )
        await system.ask("ssd_writer", SsdStatsRequest(), timeout=ASK, expect=SsdStats)
        code, report = await anyio.to_thread.run_sync(
            lambda: run_json(capsys, "purge", "--all", "--ssd-cache", str(tier))
        )
    assert code == 1
    assert report["busy"] == [str(tier / IDENTITY.fingerprint)]
    assert files(tier / IDENTITY.fingerprint, ".kvt") == before
    assert not (tier / OLD).exists()


@pytest.mark.anyio
async def test_purge_older_than_removes_only_entries_unused_for_that_long(
    tier: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An entry whose last use (mtime) is 10 days old goes with --older-than 7d; recent ones stay."""
    aged = tier / OLD / namespace_dir("") / "a.kvt"
    ten_days_ago = aged.stat().st_mtime_ns - 10 * 86400 * 10**9
    os.utime(aged, ns=(ten_days_ago, ten_days_ago))
    code, report = run_json(capsys, "purge", "--older-than", "7d", "--ssd-cache", str(tier))
    assert code == 0
    assert (report["removed_files"], report["removed_bytes"]) == (1, 1000)
    assert not aged.exists()
    assert (tier / OLD / namespace_dir("") / "b.kvt").exists()
    assert disk(tier)[IDENTITY.fingerprint][0] == 2


@pytest.mark.anyio
async def test_a_dry_run_removes_nothing(tier: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run reports what --all would remove and leaves every file."""
    before = disk(tier)
    code, report = run_json(capsys, "purge", "--all", "--dry-run", "--ssd-cache", str(tier))
    assert code == 0
    assert report["removed_files"] == 5
    assert disk(tier) == before


def test_every_unlink_is_followed_by_its_directory_fsync(tmp_path: Path) -> None:
    """purge_tier unlinks through the file port and fsyncs each directory after its unlinks (and the parents of removed dirs)."""
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    made = old_fingerprint_dir(root)
    port = RecordingPort()
    report = purge_tier(port, str(root), select_dir=lambda name: True, remove_dirs=True)
    assert report.failed == []
    ns = str(made[0].parent)
    unlinks = [i for i, (m, p) in enumerate(port.calls) if m == "unlink" and os.path.dirname(p) == ns]
    syncs = [i for i, (m, p) in enumerate(port.calls) if m == "fsync_dir" and p == ns]
    assert len(unlinks) == 3
    assert syncs
    assert syncs[-1] > max(unlinks)
    assert ("fsync_dir", str(root / OLD)) in port.calls  # the namespace dir's rmdir
    assert ("fsync_dir", str(root)) in port.calls  # the fingerprint dir's rmdir
    assert list(root.iterdir()) == []


def test_purge_refuses_a_tier_others_may_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A group-writable namespace directory: UntrustedPath, exit 1, nothing removed."""
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    made = old_fingerprint_dir(root)
    made[0].parent.chmod(0o770)
    with pytest.raises(UntrustedPath):
        purge_tier(RecordingPort(), str(root), select_dir=lambda name: True, remove_dirs=True)
    assert cli_main(["cache", "purge", "--all", "--ssd-cache", str(root)]) == 1
    assert "writable by its group or others" in capsys.readouterr().err
    assert all(p.exists() for p in made)


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("30s", 30), ("15m", 900), ("12h", 43200), ("7d", 604800), ("2w", 1209600)])
def test_ages(text: str, seconds: float) -> None:
    """--older-than reads a number with an optional s/m/h/d/w unit."""
    assert cache_cli.parse_age(text) == seconds


def test_a_bad_age_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """An unreadable age exits 2 with argparse's message naming it."""
    with pytest.raises(SystemExit) as info:
        cli_main(["cache", "purge", "--older-than", "soon"])
    assert info.value.code == 2
    assert "not an age" in capsys.readouterr().err


@pytest.mark.anyio
async def test_the_current_fingerprint_is_the_directory_a_server_of_that_model_uses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An Engine on a converted model creates exactly the directory `kvtier cache list --model` marks current."""
    from actors.engine import Engine
    from kernels import convert_gguf
    from tests.model_fixtures import tiny_llama_gguf

    gguf = tmp_path / "tiny.gguf"
    tiny_llama_gguf(gguf, seed=0)
    model_dir = convert_gguf(gguf, tmp_path / "tiny", dequantize=True)
    root = tmp_path / "kv"
    engine = Engine(model=str(model_dir), ssd_cache=root, prompt_cache_bytes=1 << 24)
    try:
        await engine.start()
    finally:
        await engine.aclose()
    (made,) = [p.name for p in root.iterdir()]
    code, listed = await anyio.to_thread.run_sync(
        lambda: run_json(capsys, "list", "--ssd-cache", str(root), "--model", str(model_dir))
    )
    assert code == 0
    assert listed["current"] == made
    assert [f["current"] for f in listed["fingerprints"]] == [True]
