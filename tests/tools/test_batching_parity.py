"""tools/bench/batching.py's served parity: answers compared with the serial tokens' text, counters from /stats."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tools._bench_modules import load_bench

batching = load_bench("batching")
common = load_bench("_common")

# NOTE: a stand-in kvtier serve: answers a chat with "ans " + the user's text,
# /stats counts one more batch step per chat answered (and one turn per two).
FAKE_SERVE = textwrap.dedent(
    """
    import argparse, http.server, json, threading
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    port = p.parse_args().port
    lock = threading.Lock()
    answered = [0]
    class H(http.server.BaseHTTPRequestHandler):
        def _send(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def do_GET(self):
            if self.path == "/stats":
                n = answered[0]
                self._send({"engine": {"batch": {"batch": {"steps": {"run": 10 + n}}},
                                       "gateway": {"token": {"batch_chains": {"granted": n // 2}}}}})
            else:
                self._send({"data": [{"id": "fake-model"}]})
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert req["model"] == "fake-model" and req["temperature"] == 0.0
            with lock:
                answered[0] += 1
            self._send({"choices": [{"message": {"content": "ans " + req["messages"][-1]["content"]}}]})
        def log_message(self, *a):
            pass
    http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


class _Tokenizer:
    """Decodes token ids as the letters a=1, b=2, ... (the serial run's text); 0 is EOS."""

    eos_token_ids = (0,)

    def decode(self, ids: list[int]) -> str:
        assert 0 not in ids, "EOS must be left out of the decoded text"
        return "".join(" " if i == 27 else chr(ord("a") + i - 1) for i in ids)


class _Lm:
    """The model bundle served_parity reads: only its tokenizer."""

    tokenizer = _Tokenizer()


@pytest.fixture
def fake_serve(tmp_path: Path) -> Iterator[str]:
    """A running stand-in server's base URL."""
    script = tmp_path / "fake_serve.py"
    script.write_text(FAKE_SERVE)
    with common.running_server([sys.executable, str(script)], tmp_path, "fake", timeout=30) as url:
        yield url


def _ids(text: str) -> list[int]:
    """The token ids _Tokenizer decodes to ``text``."""
    return [27 if c == " " else ord(c) - ord("a") + 1 for c in text]


def test_served_parity_counts_equal_answers_and_names_the_first_difference(
    fake_serve: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Equal texts count, a differing one is reported at its first differing character; steps and turns from /stats."""
    monkeypatch.setattr(batching, "PARITY_STAGGER_S", 0.01)
    convs = [[{"role": "user", "content": "xy"}], [{"role": "user", "content": "zz"}]]
    serial = [[*_ids("ans xy"), 0], _ids("ans zq")]
    lines = batching.served_parity(_Lm(), fake_serve, convs, serial, 8)
    assert lines[0].startswith("served parity: 1/2 answers equal")
    assert "2 batch steps in 1 turns" in lines[0]
    assert lines[1] == "served row 1: text differs at character 5: 'q' vs 'z'"
    assert len(lines) == 2


def test_first_difference() -> None:
    """The first differing index, or the shorter length when one sequence is the other's prefix."""
    assert batching.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert batching.first_difference([1, 2], [1, 2, 3]) == 2
    assert batching.first_difference("abc", "abc") == 3


def test_a_served_base_is_summarized_beside_this_trees_server() -> None:
    """``--serve-base``'s contender gets its own line and its ratios (of the medians): to the peer, and this tree's
    server over it, per round."""
    table = batching.Table()
    for who, seconds in (("mlx_lm.server", [8.0, 10.0]), ("kvtier serve", [4.0, 4.0]),
                         ("kvtier base", [5.0, 4.0])):
        for s in seconds:
            table.add("8", who, batching.Result(tokens=40, seconds=s, cpu_s=2 * s))
    lines = batching.summarize(table, ["mlx_lm.server", "kvtier serve", "kvtier base"])
    assert "  kvtier serve / kvtier base, load 8       : 1.111 (per round 1.25, 1.00)" in lines
    assert "  kvtier base / mlx_lm.server, load 8       : 2.000 (per round 1.60, 2.50)" in lines
    assert any(line.startswith("8         kvtier base") for line in lines)
