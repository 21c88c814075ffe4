"""Run a real ``kvtier serve`` subprocess for end-to-end tests.

The server binds port 0 and prints ``kvtier: ready at URL/v1 ...``; we read
the URL from its stdout file (files, not pipes, so a chatty server can never
block on a full pipe), then wait for ``/health``.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

__all__ = ["ServerProcess"]

_READY = re.compile(r"kvtier: ready at (http://\S+)/v1")
_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
_REPO = Path(__file__).resolve().parents[2]


def _ram_tier_off(args: tuple[str, ...]) -> bool:
    return any(a == "--prompt-cache" and float(b) == 0 for a, b in itertools.pairwise(args))


class ServerProcess:
    """A ``kvtier serve`` child process; ``url`` is the base URL (without ``/v1``).

    NOTE: ``kvtier serve`` keeps an SSD cache at ``$KVTIER_HOME/kv`` by default;
    a test server gets one of its own under ``workdir`` instead (unless the
    test names ``--ssd-cache`` or turns the RAM tier off), so runs never see
    each other's files or the user's.
    """

    def __init__(self, workdir: Path, *args: str, start_timeout: float = 90.0) -> None:
        self.workdir = workdir
        self.stdout_path = workdir / "serve.stdout"
        self.stderr_path = workdir / "serve.stderr"
        if "--ssd-cache" not in args and not _ram_tier_off(args):
            args = (*args, "--ssd-cache", str(workdir / "kv"))
        env = dict(os.environ)
        if "LD_PRELOAD" not in env and os.path.exists(_OPENBLAS):
            env["LD_PRELOAD"] = _OPENBLAS  # NOTE: 20x faster CPU matmuls; optional.
        cmd = [sys.executable, "-m", "actors.cli", "serve", "--port", "0", *args]
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=out, stderr=err)
        self.url = self._wait_ready(start_timeout)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _READY.search(self.stdout_path.read_text(errors="replace"))
            if match:
                url = match.group(1)
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop(timeout=5)
        raise RuntimeError(f"kvtier serve did not become ready:\n{self.logs()}")

    def logs(self) -> str:
        """Both output files, for failure messages."""
        return (f"--- stdout\n{self.stdout_path.read_text(errors='replace')}\n"
                f"--- stderr (tail)\n{self.stderr_path.read_text(errors='replace')[-4000:]}")

    def signal(self, signum: int = signal.SIGTERM) -> None:
        """Send a signal to the server."""
        self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        """Wait for exit; the exit code."""
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, SIGKILL as a last resort; the exit code (None if it had to be killed)."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return None
