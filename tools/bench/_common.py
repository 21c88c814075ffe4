"""Shared pieces of the side-by-side server benchmarks (``kvtier serve`` vs ``mlx_lm.server``).

Server child processes (output to files, never pipes), the deterministic
long system prompt, streaming chat requests timed to their first content
chunk, a timer of the batch kernel's steps, and a record of the machine and
its load. Used by ``tools/bench/prompt_cache.py``, ``prompt_cache_memory.py``,
``cold_tier.py``, ``overhead.py``, ``http_ab.py``, ``served_steps.py``,
``gpu_batching.py`` and others; the scripts run from the repository root as
``python tools/bench/<name>.py`` (their own directory is on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

QUESTIONS = (
    "Summarize rule 3 in one sentence.",
    "What is rule 7 about?",
    "List two rules that mention a river.",
    "Which rule comes right after rule 11?",
    "Give me a short title for these notes.",
    "What does rule 2 say about lanterns?",
    "How many rules mention copper?",
    "Rewrite rule 5 as a question.",
)
"""Questions about :func:`system_prompt`'s notes (the shared-prompt loads' user turns)."""


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


def extract_commit(commit: str, into: Path) -> tuple[str, Path]:
    """``git archive`` one commit into ``into/<short hash>``; its short hash and the tree."""
    short = subprocess.run(
        ["git", "rev-parse", "--short", commit], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = into / short
    tree.mkdir()
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return short, tree


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a server child: ours, OpenBLAS preloaded when present, ``extra`` on top."""
    env = dict(os.environ)
    if "LD_PRELOAD" not in env and os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    env.update(extra or {})
    return env


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server child process with files (not pipes) for its output."""

    def __init__(
        self,
        cmd: list[str],
        workdir: Path,
        name: str,
        env: dict[str, str] | None = None,
        cwd: Path = REPO,
    ) -> None:
        self.name = name
        self.stdout = workdir / f"{name}.stdout"
        self.stderr = workdir / f"{name}.stderr"
        self.started = time.perf_counter()
        # NOTE: output files are appended to across restarts; only what this
        # process wrote (after ``_log_start``) is searched for its URL.
        self._log_start = self.stdout.stat().st_size if self.stdout.exists() else 0
        with self.stdout.open("ab") as out, self.stderr.open("ab") as err:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=child_env(env), stdout=out, stderr=err)
        self.url = ""
        self.ready_s = 0.0

    def wait_ready(self, url: str | None, timeout: float = 180.0) -> None:
        """Wait until the server answers; kvtier prints its URL, mlx_lm gets one given."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            candidate = url
            if candidate is None:
                text = self.stdout.read_bytes()[self._log_start :].decode(errors="replace")
                match = _READY.search(text)
                candidate = match.group(1) if match else None
            if candidate is not None:
                try:
                    httpx.get(f"{candidate}/v1/models", timeout=2)
                    self.url = candidate
                    self.ready_s = time.perf_counter() - self.started
                    return
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
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

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it lingers past ``timeout``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_kvtier(
    model: Path,
    workdir: Path,
    *extra: str,
    name: str = "kvtier",
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
    cwd: Path = REPO,
) -> Server:
    """``kvtier serve`` on a free port (``cwd``: another tree's, with its ``PYTHONPATH`` in ``env``).

    NOTE: ``kvtier serve`` keeps an SSD cache at ``$KVTIER_HOME/kv`` unless
    told otherwise; a benchmark that does not name ``--ssd-cache`` gets one
    in ``workdir``, so runs never see each other's files or the user's.
    """
    args = list(extra)
    if "--ssd-cache" not in args:
        args += ["--ssd-cache", str(workdir / f"{name}-kv")]
    cmd = [sys.executable, "-m", "actors.cli", "serve", "--model", str(model), "--port", "0"]
    server = Server([*cmd, *args], workdir, name, env, cwd)
    server.wait_ready(None, timeout)
    return server


def start_mlx_lm(
    model: Path, workdir: Path, *, name: str = "mlx_lm", timeout: float = 180.0
) -> Server:
    """``mlx_lm.server`` on a free port."""
    port = free_port()
    server = Server(
        [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port)],
        workdir,
        name,
    )
    server.wait_ready(f"http://127.0.0.1:{port}", timeout)
    return server


@contextlib.contextmanager
def running_server(
    argv: list[str],
    workdir: Path,
    name: str,
    *,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
) -> Iterator[str]:
    """``argv --port <a free port>`` as a :class:`Server` child until it answers; its base URL.

    For any server that takes ``--port`` (``kvtier serve``, ``mlx_lm.server``,
    another tree's ``actors.cli`` with ``cwd`` and ``PYTHONPATH`` in ``env``);
    its output goes to ``workdir/<name>.stdout|stderr``, and it is stopped on
    the way out.
    """
    port = free_port()
    server = Server([*argv, "--port", str(port)], workdir, name, env, cwd)
    try:
        server.wait_ready(f"http://127.0.0.1:{port}", timeout)
        yield server.url
    finally:
        server.stop()


class StepTimer:
    """Start and end (``perf_counter``) of every ``step`` of a kernel class, on any thread.

    NOTE: wraps the class's ``step`` once, for the whole process (two clock
    reads a step); ``kernel`` defaults to kvtier's ``BatchGeneration``, or
    any class with a ``step`` method (a stand-in's).
    """

    def __init__(self, kernel: Any = None) -> None:
        if kernel is None:
            from kernels.engine import BatchGeneration

            kernel = BatchGeneration
        self.spans: list[tuple[float, float]] = []
        inner = kernel.step
        spans = self.spans

        def step(gen: Any, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(gen, *a, **k)
            finally:
                spans.append((t, time.perf_counter()))

        kernel.step = step

    def take_spans(self) -> list[tuple[float, float]]:
        """The steps since the last call, in start order, then forget them."""
        spans = sorted(self.spans)
        self.spans.clear()
        return spans


@dataclass
class ChatResult:
    """One streamed chat completion, timed on the client."""

    ttft_s: float
    """Request sent -> first non-empty content chunk."""
    text: str
    token_times: list[float] = field(default_factory=list)
    """Arrival time of each content chunk, seconds after the request was sent."""
    usage: dict[str, Any] | None = None
    request_id: str | None = None
    """The response's ``X-Request-Id`` (kvtier's ``request.timeline`` log line names it)."""

    @property
    def decode_tps(self) -> float:
        """Content chunks after the first, per second between the first and the last."""
        if len(self.token_times) < 2:
            return 0.0
        span = self.token_times[-1] - self.token_times[0]
        return (len(self.token_times) - 1) / span if span > 0 else 0.0

    @property
    def cached_tokens(self) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens`` when the server reported it."""
        if not self.usage:
            return None
        details = self.usage.get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return int(value) if isinstance(value, int) else None


def in_threads(fn: Callable[[int], None], n: int) -> None:
    """Run ``fn(0)`` .. ``fn(n - 1)`` on ``n`` threads at once, wait for all, re-raise the first failure."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - NOTE: re-raised on the calling thread below.
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


def stream_chat(
    url: str,
    messages: list[dict[str, str]],
    model: str,
    max_tokens: int = 4,
    timeout: float = 900,
    client: httpx.Client | None = None,
) -> ChatResult:
    """A greedy streaming chat request: TTFT, the text, per-chunk times and usage.

    ``client``: a connection pool to reuse, as a real client does (one is
    made for this request otherwise). NOTE: the clock starts after the
    client exists: ``httpx.Client()`` builds an SSL context (20-90 ms, and
    ~150 ms each when 8 threads build theirs at once, under the GIL), which
    is the benchmark's cost, not the server's.
    """
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    own = client is None
    http = httpx.Client(timeout=timeout) if client is None else client
    times: list[float] = []
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        start = time.perf_counter()
        with http.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as resp:
            resp.raise_for_status()
            request_id = resp.headers.get("x-request-id")
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                obj = json.loads(payload)
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        times.append(time.perf_counter() - start)
                        parts.append(content)
    finally:
        if own:
            http.close()
    if not times:
        raise RuntimeError("no content chunk in the stream")
    return ChatResult(ttft_s=times[0], text="".join(parts), token_times=times, usage=usage,
                      request_id=request_id)


def ttft(url: str, messages: list[dict[str, str]], model: str, max_tokens: int = 4) -> float:
    """Seconds from sending a streaming chat request to its first content chunk."""
    return stream_chat(url, messages, model, max_tokens).ttft_s


def loadavg() -> str:
    """The 1/5/15-minute load averages, as ``uptime`` prints them."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


MEMINFO_FIELDS = ("MemFree", "MemAvailable", "Cached", "Dirty", "Writeback")
"""The ``/proc/meminfo`` lines :func:`host_state` keeps (bytes)."""

GPU_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw")
"""The ``nvidia-smi --query-gpu`` fields :func:`host_state` keeps (text, as nvidia-smi prints them)."""

THROTTLE_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
"""The active clock-throttle reasons under their newer and their older ``nvidia-smi`` name.

NOTE: asked apart from :data:`GPU_FIELDS`: nvidia-smi refuses a whole query
naming one field it does not know, and drivers differ in this one's name.
"""


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """:data:`MEMINFO_FIELDS` from ``path`` in bytes; ``{}`` where there is no such file."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if key in MEMINFO_FIELDS and parts:
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        return {}
    return out


def _query_gpu(fields: tuple[str, ...], timeout_s: float) -> list[str] | None:
    """The first GPU's ``fields`` from ``nvidia-smi --query-gpu``; ``None`` without it or on its refusal."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=timeout_s, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [v.strip() for v in out.splitlines()[0].split(",")] if out.strip() else None


def gpu_state(timeout_s: float = 5.0) -> dict[str, str]:
    """:data:`GPU_FIELDS` of the first GPU from ``nvidia-smi``, and ``throttle_reasons``; ``{}`` without one."""
    values = _query_gpu(GPU_FIELDS, timeout_s)
    if values is None:
        return {}
    state = dict(zip(GPU_FIELDS, values, strict=False))
    for name in THROTTLE_FIELDS:
        reasons = _query_gpu((name,), timeout_s)
        if reasons:
            state["throttle_reasons"] = reasons[0]
            break
    return state


def host_state(workdir: Path) -> dict[str, Any]:
    """The host's memory, the free disk under ``workdir`` and the GPU's clocks, now.

    NOTE: beside :func:`host_loop`, for what grows from call to call on a
    lent machine: the page cache and dirty pages the earlier calls' SSD-tier
    files left (kvtier's 8-stream decode step slowed call by call on a fast
    host while the host probe held: docs/benchmarks.md, 2026-12-07 14:23),
    the disk they fill, and the GPU's clocks and throttle reasons.
    """
    disk = os.statvfs(workdir)
    return {"meminfo": meminfo(), "disk_free": disk.f_bavail * disk.f_frsize, "gpu": gpu_state()}


def host_state_line(state: dict[str, Any]) -> str:
    """One short line of :func:`host_state`: free / available / cached memory, dirty pages, free disk, the GPU's clock."""
    mem = state.get("meminfo", {})
    gib = 1 << 30
    parts = [f"{name.lower()} {mem[key] / gib:.1f} GiB" for key, name in
             (("MemFree", "free"), ("MemAvailable", "available"), ("Cached", "cached")) if key in mem]
    if "Dirty" in mem:
        parts.append(f"dirty {mem['Dirty'] / (1 << 20):.0f} MiB")
    parts.append(f"disk free {state.get('disk_free', 0) / gib:.1f} GiB")
    gpu = state.get("gpu", {})
    if gpu:
        parts.append(f"gpu sm {gpu.get('clocks.sm', '?')}, throttle {gpu.get('throttle_reasons', '?')}")
    return ", ".join(parts)


def host_loop(iterations: int = 2_000_000, repeats: int = 3) -> float:
    """Seconds a fixed pure-Python loop of ``iterations`` additions takes on this host, best of ``repeats``.

    NOTE: a probe of the host's single-thread speed. On a lent GPU host (a
    VM on a shared machine) it moved 1.6 x within one call (10M additions:
    0.70 s before a run, 1.14 s after; docs/benchmarks.md, 2026-12-07
    08:58), and a decode step with few rows is bound by the host, so a
    server's per-token time moves with it: each run records it beside its
    figures.
    """
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total = 0
        for i in range(iterations):
            total += i
        best = min(best, time.perf_counter() - start)
    return best


GPU_QUERY = ("name", "memory.total", "driver_version", "clocks.max.sm", "clocks.sm",
             "power.limit", "temperature.gpu", "pci.bus_id")
"""What :func:`gpus` asks ``nvidia-smi`` for, one field each."""


def gpus(run: Callable[..., Any] = subprocess.run) -> list[dict[str, str]]:
    """Each NVIDIA GPU's name, memory, driver, SM clocks, power limit, temperature and bus (``[]``: none, or no ``nvidia-smi``).

    NOTE: lent GPU hosts of one kind differ run to run (an H100 whose peer
    and kvtier both decoded 1.3-2 x slower than on the one before); the
    clocks and the bus name say which card a figure came from.
    """
    try:
        done = run(["nvidia-smi", f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader"],
                   capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    out: list[dict[str, str]] = []
    for line in str(done.stdout).splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) == len(GPU_QUERY):
            out.append(dict(zip(GPU_QUERY, values, strict=True)))
    return out


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU count, memory, Python, MLX and mlx-lm versions."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    mem_kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kb = int(line.split()[1])
    # NOTE: the device machine's copy of the tree carries a stale .git (its
    # HEAD is not the code sent); gpu_serving.sh names the code in KVTIER_COMMIT.
    commit = os.environ.get("KVTIER_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "mem_gib": round(mem_kb / 2**20, 1),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "mlx": ver("mlx"),
        "mlx_lm": ver("mlx-lm"),
        "commit": commit,
        # NOTE: Debian's path here; a carried copy elsewhere (the device's) lives in an openblas folder.
        "openblas_preloaded": "openblas" in os.environ.get("LD_PRELOAD", ""),
        "gpus": gpus(),
    }


def model_id(url: str) -> str:
    """The first model id ``/v1/models`` lists."""
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])
