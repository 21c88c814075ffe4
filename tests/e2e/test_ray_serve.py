"""End to end: kvtier on Ray Serve, 2 replicas of the default model behind Ray's HTTP proxy.

``tools/cluster/ray_serve.py`` starts a local Ray cluster and deploys
``actors.http.ray_serve.build_app`` (ingress + 2 replicas routed by Ray's
``PrefixCacheAffinityRouter``). The real ``openai`` client then asks through
Ray's proxy: a plain answer, a streamed one, and a second turn of a
conversation, which must find its first turn's prompt cached (the router
sent it to the replica holding that prefix).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]

pytest.importorskip("ray.serve")

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = ("You keep a lighthouse log. Answer in short, plain sentences and never invent "
          "entries that are not in the notes. ") * 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_url(tmp_path_factory: pytest.TempPathFactory):
    port = _free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0",
               KVTIER_HOME=os.environ.get("KVTIER_HOME", str(Path.home() / ".kvtier")))
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tools/cluster/ray_serve.py"), "--replicas", "2",
         "--replica-cpus", "0.5", "--host", "127.0.0.1", "--port", str(port),
         "--max-batch", "1", "--ssd-cache", "off"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = threading.Event()
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("kvtier: ready at "):
                ready.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        for _ in range(600):
            if ready.wait(1) or proc.poll() is not None:
                break
        assert ready.is_set(), "".join(lines[-40:])
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        reader.join(30)
        assert proc.stdout is not None
        proc.stdout.close()


def test_answers_through_ray_proxy(ray_url: str) -> None:
    """A chat answer comes back through Ray's proxy with the openai client."""
    client = openai.OpenAI(base_url=ray_url, api_key="unused", timeout=300)
    r = client.chat.completions.create(model="default", max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": "Say hello."}])
    assert r.choices[0].message.content
    assert r.usage is not None
    assert r.usage.completion_tokens > 0


def test_streams_through_ray_proxy(ray_url: str) -> None:
    """A streamed answer arrives as several chunks ending with a finish reason."""
    client = openai.OpenAI(base_url=ray_url, api_key="unused", timeout=300)
    chunks = list(client.chat.completions.create(
        model="default", max_tokens=8, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Count to five."}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 3
    assert text
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_second_turn_finds_its_prefix_cached(ray_url: str) -> None:
    """Turn 2 of each conversation lands on the replica that cached turn 1 (prefix affinity)."""
    client = openai.OpenAI(base_url=ray_url, api_key="unused", timeout=300)
    for topic in ("the north light", "the harbour bell", "the fog horn"):
        messages = [{"role": "system", "content": f"[{topic}] {SYSTEM}"},
                    {"role": "user", "content": f"Log: checked {topic}. Summarise."}]
        first = client.chat.completions.create(model="default", max_tokens=4, temperature=0,
                                               messages=messages)  # type: ignore[arg-type]
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                     {"role": "user", "content": "And the weather?"}]
        second = client.chat.completions.create(model="default", max_tokens=4, temperature=0,
                                                messages=messages)  # type: ignore[arg-type]
        assert second.usage is not None
        assert second.usage.prompt_tokens_details is not None
        cached = second.usage.prompt_tokens_details.cached_tokens or 0
        assert cached >= first.usage.prompt_tokens // 2, (topic, cached)  # type: ignore[union-attr]
