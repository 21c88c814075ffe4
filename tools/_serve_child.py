"""One ``kvtier serve`` child process for the kill -9 loops (``tools/kill_loop*.py``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["REPO", "Server"]

REPO = Path(__file__).resolve().parents[1]
_READY = re.compile(r"kvtier: ready at (http://\S+)/v1")
_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


class Server:
    """One ``kvtier serve`` child process (output to files, never pipes).

    ``append_stderr`` keeps the stderr of every start in one file (a short
    loop's whole story); otherwise each start begins it afresh.
    """

    def __init__(
        self,
        workdir: Path,
        args: list[str],
        *,
        timeout: float = 300.0,
        append_stderr: bool = False,
    ) -> None:
        self.stdout = workdir / "serve.stdout"
        self.stderr = workdir / "serve.stderr"
        env = dict(os.environ)
        if "LD_PRELOAD" not in env and os.path.exists(_OPENBLAS):
            env["LD_PRELOAD"] = _OPENBLAS
        started = time.monotonic()
        cmd = [sys.executable, "-m", "actors.cli", "serve", "--port", "0", *args]
        with self.stdout.open("wb") as out, self.stderr.open("ab" if append_stderr else "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err)
        self.url = self._wait_ready(timeout)
        self.start_s = time.monotonic() - started

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _READY.search(self.stdout.read_text(errors="replace"))
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        tail = self.stderr.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"kvtier serve did not become ready:\n{tail}")

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, and reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), SIGKILL after a minute."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
