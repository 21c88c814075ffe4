"""``GET /``: the status page, opened in headless Chromium against a live server.

A scripted engine answers ``/stats`` with known figures that change on every
call; the page must show them (model, bytes against caps, hit rates,
durability, queues, mailboxes) and refresh itself. Chromium is Debian's
``chromium`` package: installed here when missing (as root), otherwise the
test is skipped with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import uvicorn

from actors.http import HttpSettings, create_app
from actors.http._status import STATUS_PAGE

MIB = 1 << 20


def _browser_env() -> dict[str, str]:
    # NOTE: the OpenBLAS preload the test run uses for MLX makes Chromium's
    # GPU process fail to launch (and the browser abort); it needs none.
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is not None:
        return path
    if os.geteuid() != 0:
        pytest.skip("headless Chromium is missing and this test runs without root, so it "
                    "cannot install it: run `apt-get install -y chromium` (Debian)")
    for command in (["apt-get", "install", "-y", "chromium"], ["apt-get", "update"],
                    ["apt-get", "install", "-y", "chromium"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=1200, check=False)
        path = shutil.which("chromium")
        if path is not None:
            return path
    pytest.skip(f"could not install Debian's chromium package: {done.stderr[-500:]}")


@pytest.fixture(scope="module")
def chromium() -> str:
    """The path of Debian's chromium (installed by this setup when missing)."""
    return _chromium()


class _ScriptedEngine:
    """Just enough engine for the status page: a model id and a /stats that counts its calls."""

    model_id = "demo-model"
    vocab_size = None

    def __init__(self) -> None:
        self.calls = 0

    async def stats(self) -> dict[str, Any]:
        self.calls += 1
        return {
            "model": "demo-model",
            "state": "running",
            "prompt_cache": {"retained_bytes": 16 * MIB, "cap_bytes": 64 * MIB, "entries": 5,
                             "hits": 3, "ssd_hits": 1, "misses": 4},
            "ssd_cache": {"bytes": 512 * MIB, "max_bytes": 2048 * MIB, "entries": 7, "hits": 1,
                          "writebehind_dirty": 2, "pending_snapshots": 1,
                          "last_flush_durable": True, "longest_durable_prefix_tokens": 1234,
                          "pending_spills": 1, "pending_spill_bytes": MIB,
                          "spill_queue_cap_bytes": 2048 * MIB},
            "gateway": {"token": {"lane": "chatcmpl-7", "queued": 3, "max_queue": 16,
                                  "background_waiting": 2}},
            "memory": {"active_bytes": 3 * 1024 * MIB, "budget_bytes": 12 * 1024 * MIB},
            "mailboxes": {"actors": [
                {"address": "gateway", "depth": 4, "capacity": 64, "handled": 100 + self.calls,
                 "time_in_mailbox_p50": 0.0005, "time_in_mailbox_p99": 0.012,
                 "state": "running"},
                {"address": "prompt_cache", "depth": 0, "capacity": 256, "handled": 42,
                 "time_in_mailbox_p50": 0.0001, "time_in_mailbox_p99": 0.002,
                 "state": "running"},
            ]},
        }

    def begin_shutdown(self) -> None:
        """Nothing to stop."""


@pytest.fixture
def served() -> Iterator[tuple[str, _ScriptedEngine]]:
    """A live uvicorn server (own thread) serving the app over the scripted engine."""
    engine = _ScriptedEngine()
    app = create_app(cast("Any", engine), HttpSettings())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False,
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


class _Figures(HTMLParser):
    """Collects the text of every ``data-figure`` element and the mailbox rows."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: dict[str, str] = {}
        self.rows: dict[str, list[str]] = {}
        self._open: list[tuple[str, str | None, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self._open.append((tag, a.get("data-figure"), a.get("data-actor")))
        if a.get("data-figure") is not None:
            self.figures[str(a["data-figure"])] = ""
        if a.get("data-actor") is not None:
            self.rows[str(a["data-actor"])] = []
        if tag == "td" and self._row() is not None:
            self.rows[str(self._row())].append("")

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, figure, _ in self._open:
            if figure is not None:
                self.figures[figure] += data
        row = self._row()
        if row is not None and self._open and self._open[-1][0] == "td":
            self.rows[row][-1] += data

    def _row(self) -> str | None:
        return next((actor for _, _, actor in reversed(self._open) if actor), None)


def test_the_status_page_shows_the_figures_and_refreshes_itself(
    served: tuple[str, _ScriptedEngine], chromium: str, tmp_path: Path
) -> None:
    """Headless Chromium renders the page from /stats: the model, each tier's bytes against its
    cap and hit rate, durability, queues, memory and every mailbox; within 5 s of (virtual)
    time it fetched /stats again and shows the later figures; a screenshot is taken."""
    url, engine = served
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
         "--dump-dom", f"{url}/"],
        capture_output=True, text=True, timeout=120, check=True, env=_browser_env(),
    ).stdout
    page = _Figures()
    page.feed(dom)
    f = {k: " ".join(v.split()) for k, v in page.figures.items()}
    assert f["model"] == "demo-model"
    assert (f["ram-bytes"], f["ram-cap"], f["ram-entries"]) == ("16.0 MiB", "64.0 MiB", "5")
    assert (f["lookups"], f["ram-hits"], f["ram-hit-rate"]) == ("8", "3", "37.5 %")
    assert (f["ssd-bytes"], f["ssd-cap"], f["ssd-entries"]) == ("512.0 MiB", "2.0 GiB", "7")
    assert (f["ssd-hits"], f["ssd-hit-rate"]) == ("1", "12.5 %")
    assert (f["dirty"], f["pending-snapshots"], f["last-flush"]) == ("2", "1", "durable")
    assert f["longest-durable"] == "1234 tokens"
    assert f["spill-queue"] == "1 items, 1.0 MiB of 2.0 GiB"
    assert (f["lane"], f["queued"], f["background"]) == ("chatcmpl-7", "3 of 16", "2")
    assert f["memory"] == "3.0 GiB / 12.0 GiB"
    assert f["in-flight"] == "0"
    assert page.rows["gateway"][:3] == ["gateway", "4", "64"]
    assert page.rows["gateway"][4:] == ["0.50 ms", "12.00 ms", "running"]
    assert page.rows["prompt_cache"][1:4] == ["0", "256", "42"]
    # NOTE: the page refreshes every 2 s: the handled count shown is a later call's
    # (the first call shows 101).
    assert 102 <= int(page.rows["gateway"][3]) <= 100 + engine.calls
    assert f["updated"] != "never"

    shot = tmp_path / "status.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                    "--virtual-time-budget=3000", "--window-size=1280,860",
                    f"--screenshot={shot}", f"{url}/"],
                   capture_output=True, timeout=120, check=True, env=_browser_env())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.anyio
async def test_the_page_is_self_contained_and_served_without_the_api_key(
    served: tuple[str, _ScriptedEngine],
) -> None:
    """The HTML names no other origin (no CDN, no external script, style or font), its CSP
    allows only this origin, and it is served without the key (it holds no data)."""
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", STATUS_PAGE)
    assert not re.search(r"https?://", STATUS_PAGE)
    assert "@import" not in STATUS_PAGE
    url, _ = served
    async with httpx.AsyncClient(timeout=10) as live:
        r = await live.get(f"{url}/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    keyed = create_app(cast("Any", _ScriptedEngine()), HttpSettings(api_key="k"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=keyed),
                                 base_url="http://t") as client:
        assert (await client.get("/")).status_code == 200
        assert (await client.get("/stats")).status_code == 401
