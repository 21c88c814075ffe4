"""A real disk-full run: ``kvtier serve`` with its SSD tier on a 1 MiB tmpfs.

The byte cap (1 GiB) is far above what the file system holds, so the disk
fills first. The stores then fail softly (``disk_full``, one warning per
run), a flush says ``durable: false`` (503), nothing half-written is
visible, the index matches the files, and requests keep being served with
the same answers. Once the file system grows (remounted larger), the next
flush writes what was left and answers ``durable: true``; a restart on the
directory finds exactly those files, none corrupt.

Needs root and a kernel that lets this process mount tmpfs; skipped with
the reason otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernels.cache import OsFilePort, read_header, read_tensors
from tools._serve_child import Server
from tools.kill_loop_cold import write_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = 12
JSON = {"content-type": "application/json"}
"""Every POST says it is JSON (the server answers 415 otherwise)."""


def _mount(target: Path, size: str, *, remount: bool = False) -> str | None:
    """Mount (or remount) a tmpfs of ``size`` at ``target``; the error text, or None."""
    # NOTE: mode 0700: a tmpfs root is 1777 by default, and the SSD tier
    # refuses a directory others may write to (untrusted files).
    opts = f"remount,size={size}" if remount else f"size={size},mode=0700"
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(target)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted afterwards (skips when mounting is impossible here)."""
    target = tmp_path / "kv"
    target.mkdir()
    error = _mount(target, "1m")
    if error is not None:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount rights): {error}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False, timeout=30)


def _text(i: int) -> str:
    return f"Keeper's log {i}: " + " ".join(
        ("wind", "lamp", "oil", "reef", "fog", "tide", "ship", "bell")[(i * 7 + k) % 8]
        for k in range(150 + 20 * i)
    )


def _complete(http: httpx.Client, url: str, text: str) -> dict[str, Any]:
    r = http.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _ssd(http: httpx.Client, url: str) -> dict[str, Any]:
    out: dict[str, Any] = http.get(f"{url}/stats").json()["engine"]["ssd_cache"]
    return out


def _files(root: Path) -> tuple[list[Path], list[Path]]:
    """Entry files and temp files under ``root``."""
    entries = sorted(p for p in root.rglob("*.kvt") if p.is_file())
    temps = sorted(p for p in root.rglob("*.kvt.tmp") if p.is_file())
    return entries, temps


def _check_files(root: Path, ssd: dict[str, Any]) -> list[Path]:
    """No temp file; every entry file reads back with every hash right; the index matches."""
    entries, temps = _files(root)
    assert temps == []
    port = OsFilePort()
    for path in entries:
        header = read_header(port, str(path))
        read_tensors(port, str(path), header, verify=True)
    assert ssd["entries"] == len(entries)
    assert ssd["bytes"] + ssd["leftover_bytes"] == sum(p.stat().st_size for p in entries)
    assert ssd["leftover_files"] == 0
    assert ssd["reserved_bytes"] == 0
    return entries


@pytest.mark.timeout(900)
def test_a_full_disk_fails_stores_softly_and_requests_keep_being_served(
    tmp_path: Path, small_fs: Path
) -> None:
    """Stores fail with disk_full (warned once), flushes say not durable, nothing half-written
    is visible, the index matches the disk, every request is answered as before; after the
    file system grows, a flush is durable again and a restart finds the same files."""
    model = write_tiny_model(tmp_path / "model")
    work = tmp_path / "serve"
    work.mkdir()
    args = ["--model", str(model), "--ssd-cache", str(small_fs), "--ssd-cache-max", "1",
            "--ssd-writebehind", "off", "--admin-loopback", "on"]  # fmt: skip
    server = Server(work, args)
    statuses: list[int] = []
    answers: dict[int, str] = {}
    try:
        with httpx.Client(timeout=300) as http:
            for i in range(PROMPTS):
                answers[i] = _complete(http, server.url, _text(i))["choices"][0]["text"]
                r = http.post(f"{server.url}/admin/cache/flush", headers=JSON)
                statuses.append(r.status_code)
                if r.status_code != 200:
                    assert r.json()["durable"] is False
            ssd = _ssd(http, server.url)
            assert ssd["disk_full"] >= 2
            assert ssd["store_failures"] >= ssd["disk_full"]
            full = _check_files(small_fs, ssd)
            # NOTE: the same prompts again: served (from RAM) with the same answers.
            for i in range(PROMPTS):
                repeat = _complete(http, server.url, _text(i))
                assert repeat["choices"][0]["text"] == answers[i]
            assert _mount(small_fs, "64m", remount=True) is None
            r = http.post(f"{server.url}/admin/cache/flush", headers=JSON)
            assert r.status_code == 200, r.text
            assert r.json()["durable"] is True
            after = _check_files(small_fs, _ssd(http, server.url))
            assert len(after) > len(full)
    finally:
        server.stop()
    assert server.proc.returncode == 0
    assert statuses[0] == 200
    assert 503 in statuses
    log = (work / "serve.stdout").read_text() + (work / "serve.stderr").read_text()
    assert log.count("ssd_cache.disk_full") == 1, log[-3000:]
    print(f"flush statuses: {statuses}; {len(full)} files on the full disk, {len(after)} after",
          file=sys.stderr)  # fmt: skip

    again = Server(work, args)
    try:
        with httpx.Client(timeout=300) as http:
            ssd = _ssd(http, again.url)
            assert (ssd["corrupt_removed"], ssd["orphans_reaped"]) == (0, 0)
            assert _check_files(small_fs, ssd) == after
    finally:
        again.stop()
