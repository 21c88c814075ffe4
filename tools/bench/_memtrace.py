"""Where a server child's resident memory is (Linux ``/proc``), for ``prompt_cache_memory.py --trace-memory``.

Read from outside the process, so the server runs unchanged:

- ``/proc/PID/status``: RSS, its anonymous / file-backed split, peak RSS
  (VmHWM), threads;
- ``/proc/PID/smaps``: the anonymous memory split by what holds it: the
  main heap (``[heap]``, glibc's main arena), the glibc per-thread arenas
  (anonymous mappings 64 MiB-aligned that, with their ``---p`` tail, span
  exactly 64 MiB: glibc's ``HEAP_MAX_SIZE``), thread stacks (a ``---p``
  guard page right below a read-write mapping) and the rest (large
  ``mmap``-ed blocks: MLX buffers above glibc's mmap threshold, the
  interpreter's arenas);
- the server's ``/stats`` (the memory guard's last reading, MLX's active /
  cache / peak memory where the server reports them, the tiers' bytes).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = ["MemorySample", "PeakWatch", "sample", "status_fields"]

_ARENA = 64 * 1024 * 1024
_MAP = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)\s*(.*)$")


def status_fields(pid: int) -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` (bytes) and ``Threads`` from ``/proc/PID/status``."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
        elif key == "Threads":
            out[key] = int(value)
    return out


@dataclass
class _Region:
    start: int
    end: int
    perms: str
    anonymous: bool
    name: str
    rss: int = 0


def _regions(pid: int) -> list[_Region]:
    regions: list[_Region] = []
    current: _Region | None = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        m = _MAP.match(line)
        if m is not None:
            start, end, perms, inode, name = m.groups()
            current = _Region(int(start, 16), int(end, 16), perms,
                              inode == "0" and (not name or name == "[heap]"), name)
            regions.append(current)
        elif current is not None and line.startswith("Rss:"):
            current.rss = int(line.split()[1]) * 1024
    return regions


def anon_breakdown(pid: int) -> dict[str, int]:
    """Resident anonymous bytes by holder, and the number of glibc arenas and thread stacks."""
    regions = _regions(pid)
    out = {"heap": 0, "arenas": 0, "arena_count": 0, "stacks": 0, "stack_count": 0,
           "other_anon": 0, "file": 0}
    for i, r in enumerate(regions):
        if not r.anonymous:
            out["file"] += r.rss
            continue
        if r.name == "[heap]":
            out["heap"] += r.rss
            continue
        nxt = regions[i + 1] if i + 1 < len(regions) else None
        prev = regions[i - 1] if i > 0 else None
        size = r.end - r.start
        tail = (nxt.end - nxt.start) if (nxt is not None and nxt.start == r.end
                                         and nxt.perms.startswith("---") and nxt.anonymous) else 0
        if r.perms.startswith("rw") and r.start % _ARENA == 0 and size + tail == _ARENA:
            out["arenas"] += r.rss
            out["arena_count"] += 1
        elif (r.perms.startswith("rw") and prev is not None and prev.end == r.start
              and prev.perms.startswith("---") and prev.anonymous and prev.end - prev.start == 4096):
            out["stacks"] += r.rss
            out["stack_count"] += 1
        elif r.perms.startswith("---"):
            continue
        else:
            out["other_anon"] += r.rss
    return out


def _stats(url: str) -> dict[str, Any]:
    try:
        resp = httpx.get(f"{url}/stats", timeout=30)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    engine: dict[str, Any] = resp.json().get("engine", {})
    memory = engine.get("memory", {})
    ssd = engine.get("ssd_cache") or {}
    pc = engine.get("prompt_cache") or {}
    reg = engine.get("cache_registry") or {}
    rows = ((engine.get("batch") or {}).get("batch") or {}).get("rows") or {}
    return {
        "mlx_bytes": memory.get("mlx_bytes"),
        "mlx_active": memory.get("mlx_active_bytes"),
        "mlx_cache": memory.get("mlx_cache_bytes"),
        "mlx_peak": memory.get("mlx_peak_bytes"),
        "ram_tier": pc.get("bytes"),
        "pending_disposal": pc.get("pending_disposal_bytes"),
        "registry": reg.get("nbytes"),
        "registry_pending": reg.get("pending_bytes"),
        "spill_pending": ssd.get("pending_spill_bytes"),
        "spilled": pc.get("spilled"),
        "ssd_spills": ssd.get("spills"),
        "dropped_spills": ssd.get("dropped_spills"),
        "staging": ssd.get("staging_bytes"),
        "rows_joined": rows.get("joined"),
        "heap_trims": memory.get("heap_trims"),
    }


@dataclass
class MemorySample:
    """One reading of a server child's memory (bytes unless named ``*_count``)."""

    label: str
    status: dict[str, int]
    anon: dict[str, int]
    stats: dict[str, Any]

    def line(self) -> str:
        """One human-readable line (MB)."""
        mb = lambda v: "-" if v is None else f"{v / 1e6:.1f}"  # noqa: E731
        s, a, t = self.status, self.anon, self.stats
        return (
            f"{self.label}: rss {mb(s.get('VmRSS'))} hwm {mb(s.get('VmHWM'))} "
            f"anon {mb(s.get('RssAnon'))} file {mb(s.get('RssFile'))} thr {s.get('Threads')} | "
            f"heap {mb(a['heap'])} arenas {mb(a['arenas'])}/{a['arena_count']} "
            f"stacks {mb(a['stacks'])}/{a['stack_count']} other {mb(a['other_anon'])} | "
            f"mlx {mb(t.get('mlx_bytes'))} act {mb(t.get('mlx_active'))} "
            f"cache {mb(t.get('mlx_cache'))} peak {mb(t.get('mlx_peak'))} "
            f"ram {mb(t.get('ram_tier'))} reg {mb(t.get('registry'))}+{mb(t.get('registry_pending'))} "
            f"spillq {mb(t.get('spill_pending'))} staging {mb(t.get('staging'))} "
            f"spilled {t.get('spilled')} rows {t.get('rows_joined')} trims {t.get('heap_trims')}"
        )


def sample(pid: int, url: str, label: str) -> MemorySample:
    """Read everything once."""
    return MemorySample(label, status_fields(pid), anon_breakdown(pid), _stats(url))


@dataclass
class PeakWatch:
    """Polls RSS every ``interval`` s on a thread; keeps the breakdown at the highest RSS seen."""

    pid: int
    url: str
    interval: float = 0.1
    best: MemorySample | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> PeakWatch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        high = 0
        while not self._stop.wait(self.interval):
            try:
                rss = status_fields(self.pid)["VmRSS"]
            except (OSError, KeyError):
                return
            if rss > high:
                high = rss
                # NOTE: the smaps walk costs ~10 ms; taken only at a new high.
                self.best = MemorySample("at peak", status_fields(self.pid),
                                         anon_breakdown(self.pid), {})
