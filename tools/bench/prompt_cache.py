"""Prompt-cache TTFT: kvtier serve vs mlx_lm.server, side by side in one run.

A ~3.4k-token system prompt, three requests per server, each measured as the
time from sending a streaming chat request to its first content chunk:

- cold:          a system prompt neither server has seen (a fresh nonce);
- shared-prefix: the same system prompt with a different user question;
- exact-repeat:  the shared-prefix request again, byte for byte.

Servers run one after the other (never together: the CPU is shared), both on
the default model directory. Prints TTFTs, warm/cold ratios and kvtier/mlx_lm
ratios. Run:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python tools/bench/prompt_cache.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
_READY = re.compile(r"kvtier: ready at (http://\S+)/v1")

WORDS = [
    "policy",
    "ledger",
    "archive",
    "river",
    "lantern",
    "copper",
    "orchard",
    "signal",
    "harbor",
    "meadow",
    "quartz",
    "timber",
    "violet",
    "summit",
    "canyon",
    "beacon",
    "ember",
    "falcon",
    "glacier",
    "hollow",
    "island",
    "jasmine",
    "kettle",
    "lagoon",
    "marble",
    "nectar",
    "oyster",
    "pepper",
    "quiver",
    "ribbon",
]


def system_prompt(target_tokens: int, nonce: str) -> str:
    """A deterministic filler text of about ``target_tokens`` tokens, tagged with ``nonce``."""
    out = [f"Session {nonce}. You are a careful assistant. Reference notes follow."]
    i = 0
    # NOTE: ~1.25 tokens per word for this vocabulary under SmolLM2's tokenizer.
    while len(out) < int(target_tokens / 1.25):
        out.append(WORDS[(i * 7 + i // 31) % len(WORDS)])
        if i % 12 == 11:
            out.append(f"rule {i // 12}.")
        i += 1
    return " ".join(out)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    if "LD_PRELOAD" not in env and os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server child process with files (not pipes) for its output."""

    def __init__(self, cmd: list[str], workdir: Path, name: str) -> None:
        self.name = name
        self.stdout = workdir / f"{name}.stdout"
        self.stderr = workdir / f"{name}.stderr"
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=out, stderr=err)
        self.url = ""

    def wait_ready(self, url: str | None, timeout: float = 180.0) -> None:
        """Wait until the server answers; kvtier prints its URL, mlx_lm gets one given."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            candidate = url
            if candidate is None:
                match = _READY.search(self.stdout.read_text(errors="replace"))
                candidate = match.group(1) if match else None
            if candidate is not None:
                try:
                    httpx.get(f"{candidate}/v1/models", timeout=2)
                    self.url = candidate
                    return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} did not start: {self.stderr.read_text()[-3000:]}")

    def peak_rss_bytes(self) -> int:
        """The process's peak resident set size (VmHWM) so far."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def rss_bytes(self) -> int:
        """The process's resident set size now (VmRSS)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_kvtier(model: Path, workdir: Path, *extra: str) -> Server:
    """``kvtier serve`` on a free port."""
    server = Server(
        [sys.executable, "-m", "actors.cli", "serve", "--model", str(model), "--port", "0", *extra],
        workdir,
        "kvtier",
    )
    server.wait_ready(None)
    return server


def start_mlx_lm(model: Path, workdir: Path) -> Server:
    """``mlx_lm.server`` on a free port."""
    port = _free_port()
    server = Server(
        [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port)],
        workdir,
        "mlx_lm",
    )
    server.wait_ready(f"http://127.0.0.1:{port}")
    return server


def ttft(url: str, messages: list[dict[str, str]], model: str, max_tokens: int = 4) -> float:
    """Seconds from sending a streaming chat request to its first content chunk."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    start = time.perf_counter()
    first: float | None = None
    with (
        httpx.Client(timeout=600) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp,
    ):
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                payload = line[5:].strip()
                if payload != "[DONE]" and '"content":""' not in payload.replace(" ", ""):
                    first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no content chunk in the stream")
    return first


def run_scenarios(url: str, model: str, tokens: int, repeats: int, tag: str) -> dict[str, float]:
    """Median TTFT of cold / shared-prefix / exact-repeat over ``repeats`` fresh prompts."""
    cold: list[float] = []
    shared: list[float] = []
    repeat: list[float] = []
    ttft(url, [{"role": "user", "content": "warm up"}], model)
    for r in range(repeats):
        system = system_prompt(tokens, f"{tag}-{r}-{time.time_ns()}")
        first = [{"role": "system", "content": system}, {"role": "user", "content": "Summarize rule 3."}]
        second = [{"role": "system", "content": system}, {"role": "user", "content": "What is rule 7?"}]
        cold.append(ttft(url, first, model))
        shared.append(ttft(url, second, model))
        repeat.append(ttft(url, second, model))
    return {
        "cold": statistics.median(cold),
        "shared": statistics.median(shared),
        "repeat": statistics.median(repeat),
    }


def main() -> int:
    """Run both servers and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model dir (default model if unset)")
    parser.add_argument("--tokens", type=int, default=3400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-mlx-lm", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from kernels import ensure_default_model

        args.model = ensure_default_model()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = start_kvtier(args.model, work, "--prompt-cache", "2")
        try:
            model_id = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            results["kvtier"] = run_scenarios(server.url, model_id, args.tokens, args.repeats, "kv")
        finally:
            server.stop()
        if not args.skip_mlx_lm:
            server = start_mlx_lm(args.model, work)
            try:
                results["mlx_lm.server"] = run_scenarios(
                    server.url, str(args.model), args.tokens, args.repeats, "ml"
                )
            finally:
                server.stop()
    print(f"system prompt ~{args.tokens} tokens, median of {args.repeats}, TTFT in ms")
    print(f"{'server':<14}{'cold':>10}{'shared':>10}{'repeat':>10}{'shared/cold':>13}{'repeat/cold':>13}")
    for name, r in results.items():
        print(
            f"{name:<14}{r['cold'] * 1e3:>10.1f}{r['shared'] * 1e3:>10.1f}{r['repeat'] * 1e3:>10.1f}"
            f"{r['shared'] / r['cold']:>13.4f}{r['repeat'] / r['cold']:>13.4f}"
        )
    if "mlx_lm.server" in results:
        k, m = results["kvtier"], results["mlx_lm.server"]
        for key in ("cold", "shared", "repeat"):
            print(f"kvtier/mlx_lm {key:<7} TTFT ratio: {k[key] / m[key]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
