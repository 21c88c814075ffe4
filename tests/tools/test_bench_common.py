"""tools/bench/_common.py: the shared server start (``running_server``) and the kernel step timer."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.tools._bench_modules import load_bench

common = load_bench("_common")

# NOTE: a stand-in server: takes ``--port`` as kvtier serve and mlx_lm.server
# do, answers /v1/models with the directory it runs in, says on stderr that it
# started. Standard library only, so it starts in well under a second.
FAKE_SERVER = textwrap.dedent(
    """
    import argparse, http.server, json, os, sys
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    port = p.parse_args().port
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": os.getcwd()}], "env": os.environ.get("FAKE_TAG", "")})
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())
        def log_message(self, *a):
            pass
    print("fake server up", file=sys.stderr, flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def test_running_server_serves_from_cwd_with_env_and_stops(tmp_path: Path) -> None:
    """The child gets ``--port``, runs in ``cwd`` with ``env`` on top, answers at the URL, and is gone after."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    tree = tmp_path / "tree"
    tree.mkdir()
    argv = [sys.executable, str(script)]
    with common.running_server(argv, tmp_path, "fake", cwd=tree, env={"FAKE_TAG": "t1"}, timeout=30) as url:
        answer = httpx.get(f"{url}/v1/models", timeout=5).json()
        assert url.startswith("http://127.0.0.1:")
        assert answer["data"][0]["id"] == str(tree)
        assert answer["env"] == "t1"
    assert "fake server up" in (tmp_path / "fake.stderr").read_text()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/v1/models", timeout=2)


def test_running_server_reports_a_child_that_exits(tmp_path: Path) -> None:
    """A child that dies before answering raises with the tail of its stderr, not a hang."""
    argv = [sys.executable, "-c", "import sys; sys.exit('no such model here')"]
    with (
        pytest.raises(RuntimeError, match="no such model here"),
        common.running_server(argv, tmp_path, "dead", timeout=30),
    ):
        pytest.fail("the body ran for a server that never started")


class _Kernel:
    """A kernel class whose ``step`` returns its argument (or raises on a negative one)."""

    def step(self, x: int) -> int:
        if x < 0:
            raise ValueError(x)
        return x


def test_step_timer_records_each_step_and_forgets_on_take() -> None:
    """Every ``step`` call (also a failing one) leaves one (start, end) span; ``take_spans`` clears them."""
    timer = common.StepTimer(_Kernel)
    k: Any = _Kernel()
    assert k.step(3) == 3
    with pytest.raises(ValueError, match="-1"):
        k.step(-1)
    spans = timer.take_spans()
    assert len(spans) == 2
    assert all(a <= b for a, b in spans)
    assert spans[0][1] <= spans[1][0]
    assert timer.take_spans() == []


class _Ran:
    """A finished ``subprocess.run`` as :func:`gpus` reads it."""

    def __init__(self, returncode: int, stdout: str) -> None:
        self.returncode = returncode
        self.stdout = stdout


def test_gpus_reads_each_card_and_tolerates_no_driver() -> None:
    """Each nvidia-smi line becomes one card's fields; a missing tool, a failure or a short line gives nothing."""
    line = "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04, 1980 MHz, 1980 MHz, 700.00 W, 33, 00000000:18:00.0"
    asked: list[list[str]] = []

    def two_cards(cmd: list[str], **_kw: Any) -> _Ran:
        asked.append(cmd)
        return _Ran(0, f"{line}\n{line.replace('18:00', '2A:00')}\nshort, line\n")

    cards = common.gpus(two_cards)
    assert [c["pci.bus_id"] for c in cards] == ["00000000:18:00.0", "00000000:2A:00.0"]
    assert cards[0]["name"] == "NVIDIA H100 80GB HBM3"
    assert cards[0]["clocks.sm"] == "1980 MHz"
    assert asked[0][0] == "nvidia-smi"
    assert common.gpus(lambda *_a, **_k: _Ran(9, line)) == []

    def absent(*_a: Any, **_k: Any) -> _Ran:
        raise FileNotFoundError("nvidia-smi")

    assert common.gpus(absent) == []
    assert isinstance(common.machine()["gpus"], list)
