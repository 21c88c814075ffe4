"""N ``kvtier serve`` replicas and a router in front of them, on one host.

    python tools/cluster/launch.py --replicas 2 --port 8000 --policy cache_aware \\
        --workdir /tmp/kvtier-cluster -- --max-batch 4

starts the replicas (each on its own port, with its own SSD directory
``WORKDIR/kv-I`` and its own ``--kv-events`` PUB and replay ports; the
model directory is shared), waits until each answers ``/health``, then
starts the router on ``--port`` and prints its URL. ``--policy`` is an
``sglang-router`` policy (``cache_aware``, ``round_robin``, ...; the
router is ``python -m sglang_router.launch_router``) or ``events``, the
minimal event-driven router of ``tools/cluster/event_router.py``
(subscribes to every replica's KV events). Arguments after ``--`` go to
every ``kvtier serve``. SIGINT or SIGTERM stops the router, then every
replica with SIGTERM (each flushes its RAM tier to its SSD directory), and
the exit status is non-zero when a replica did not exit cleanly.

Across hosts, run ``kvtier serve`` on each host and the router on one
(docs/scale-out.md); this script is the single-host form, and the
:class:`Cluster` class is what the tests and ``tools/bench/cluster.py`` use.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

__all__ = ["EVENT_POLICIES", "SGLANG_POLICIES", "Cluster", "Replica", "Router", "free_port", "main", "replica_cpus",
           "router_command"]

REPO = Path(__file__).resolve().parents[2]
_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
_READY = re.compile(r"kvtier: ready at (http://\S+)/v1")
SGLANG_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
"""``sglang-router`` policies this launcher passes through (``events`` is ours)."""
EVENT_POLICIES = {"events": "prefix", "events_prefill": "prefill"}
"""The event router's policies and the ``--rule`` each runs (``tools/cluster/event_router.py``)."""


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if "LD_PRELOAD" not in env and os.path.exists(_OPENBLAS):
        env["LD_PRELOAD"] = _OPENBLAS  # NOTE: 20x faster CPU matmuls; optional.
    if threads is not None:
        # NOTE: the BLAS pool is the CPU backend's only multi-threaded part;
        # without a bound every replica starts one thread per core.
        env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = str(threads)
    return env


def replica_cpus(index: int, replicas: int, cpus: Sequence[int]) -> set[int]:
    """The cores replica ``index`` of ``replicas`` is pinned to: an equal share of ``cpus``.

    With at least as many cores as replicas each replica gets its own
    ``len(cpus) // replicas`` cores; with fewer, replicas share cores in
    turn (replica ``i`` on core ``i % len(cpus)``), so no core holds two
    replicas more than another does.
    """
    if not cpus:
        raise ValueError("no cores to pin to")
    ordered = sorted(cpus)
    per = len(ordered) // replicas
    if per >= 1:
        return set(ordered[index * per:(index + 1) * per])
    return {ordered[index % len(ordered)]}


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """SIGTERM, wait ``timeout``, SIGKILL as a last resort; the exit status (None: killed)."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        return None


@dataclass
class Replica:
    """One ``kvtier serve`` child: its URL, KV-event endpoints and output files."""

    index: int
    workdir: Path
    kv_events: str
    """The PUB endpoint (``tcp://127.0.0.1:PORT``)."""
    kv_replay: str
    """The replay ROUTER endpoint."""
    proc: subprocess.Popen[bytes]
    url: str = ""
    ssd_dir: Path | None = None
    """The SSD directory this launcher gave it (None: the caller's ``--ssd-cache``)."""

    @classmethod
    def start(cls, index: int, workdir: Path, serve_args: Sequence[str], *,
              host: str = "127.0.0.1", port: int = 0, events: bool = True,
              threads: int | None = None, cpus: set[int] | None = None) -> Replica:
        """Start replica ``index`` (output to ``workdir/replica-I.*``); :meth:`wait_ready` next.

        ``threads`` bounds its BLAS threads; ``cpus`` pins it to those cores.
        """
        pub = f"tcp://127.0.0.1:{free_port()}" if events else "off"
        replay = f"tcp://127.0.0.1:{free_port()}" if events else "off"
        args = list(serve_args)
        ssd_dir = None
        if "--ssd-cache" not in args:
            # NOTE: an SSD directory is locked by one server: one per replica.
            ssd_dir = workdir / f"kv-{index}"
            args += ["--ssd-cache", str(ssd_dir)]
        cmd = [sys.executable, "-m", "actors.cli", "serve", "--host", host, "--port", str(port),
               "--kv-events", pub, "--kv-events-replay", replay, *args]
        out_path = workdir / f"replica-{index}.stdout"
        err_path = workdir / f"replica-{index}.stderr"
        with out_path.open("wb") as out, err_path.open("wb") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=_env(threads), stdout=out, stderr=err)
        if cpus is not None:
            # NOTE: pinned before it loads the model (its threads inherit the set).
            os.sched_setaffinity(proc.pid, cpus)
        return cls(index, workdir, pub, replay, proc, ssd_dir=ssd_dir)

    def wait_ready(self, timeout: float) -> None:
        """Wait until the replica printed its URL and ``/health`` answers 200."""
        out_path = self.workdir / f"replica-{self.index}.stdout"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _READY.search(out_path.read_text(errors="replace"))
            if match:
                try:
                    if httpx.get(f"{match.group(1)}/health", timeout=5).status_code == 200:
                        self.url = match.group(1)
                        return
                except httpx.HTTPError:
                    pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        err = (self.workdir / f"replica-{self.index}.stderr").read_text(errors="replace")
        raise RuntimeError(f"replica {self.index} did not become ready:\n{err[-3000:]}")

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM (the replica flushes its RAM tier), SIGKILL after ``timeout``; the exit status."""
        return _stop(self.proc, timeout)


def router_command(policy: str, urls: Sequence[str], events: Sequence[tuple[str, str]], *,
                   host: str, port: int, model: str | None = None,
                   balance: tuple[float, float] | None = None) -> list[str]:
    """The command line of the router for ``policy`` in front of the replicas at ``urls``.

    ``events``: each replica's (PUB, replay) endpoints, for ``events``.
    ``balance`` (abs, rel): sglang-router's ``--balance-abs-threshold`` and
    ``--balance-rel-threshold``, given to ``cache_aware`` and to the event
    router alike (None: each one's default, 64 and 1.5 for both).
    """
    balance_args = [] if balance is None else [
        "--balance-abs-threshold", f"{balance[0]:g}", "--balance-rel-threshold", f"{balance[1]:g}"]
    if policy in EVENT_POLICIES:
        cmd = [sys.executable, str(REPO / "tools" / "cluster" / "event_router.py"),
               "--host", host, "--port", str(port), "--rule", EVENT_POLICIES[policy],
               *balance_args]
        if model is not None:
            cmd += ["--model", model]
        for url, (pub, replay) in zip(urls, events, strict=True):
            cmd += ["--replica", f"{url},{pub},{replay}"]
    elif policy in SGLANG_POLICIES:
        # NOTE: sglang-router 0.3.2's circuit breaker counts a replica's
        # 4xx answers as failures: two invalid client requests in a row
        # opened every circuit for 60 s (503 no_available_workers to every
        # client). Dead replicas still leave through its health checks.
        # Its Prometheus exporter binds 0.0.0.0:29000 by default (a second
        # router on the host then panics): our host, a free port.
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host,
               "--port", str(port), "--policy", policy, "--log-level", "warn",
               "--disable-circuit-breaker", "--prometheus-host", host,
               "--prometheus-port", str(free_port()),
               *(balance_args if policy == "cache_aware" else []),
               "--worker-urls", *urls]
    else:
        raise ValueError(f"unknown policy {policy!r}")
    return cmd


@dataclass
class Router:
    """A router child process in front of the replicas: ``sglang-router`` or ``event_router``."""

    policy: str
    url: str
    proc: subprocess.Popen[bytes]

    @classmethod
    def start(cls, policy: str, replicas: Sequence[Replica], workdir: Path, *,
              host: str = "127.0.0.1", port: int = 0, model: str | None = None,
              timeout: float = 60.0, balance: tuple[float, float] | None = None) -> Router:
        """Start the router for ``policy`` and wait until it forwards ``/v1/models``.

        ``balance``: as in :func:`router_command`.
        """
        port = port or free_port()
        cmd = router_command(policy, [r.url for r in replicas],
                             [(r.kv_events, r.kv_replay) for r in replicas]
                             if policy in EVENT_POLICIES else [], host=host,
                             port=port, model=model, balance=balance)
        name = f"router-{policy}"
        with (workdir / f"{name}.stdout").open("wb") as out, \
                (workdir / f"{name}.stderr").open("wb") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=out, stderr=err)
        router = cls(policy, f"http://{host}:{port}", proc)
        router._wait_ready(workdir / f"{name}.stderr", timeout)
        return router

    def _wait_ready(self, err_path: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"router {self.policy} did not become ready:\n"
                           f"{err_path.read_text(errors='replace')[-3000:]}")

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, SIGKILL after ``timeout``; the exit status."""
        return _stop(self.proc, timeout)


@dataclass
class Cluster:
    """N replicas (started together, so their model loads overlap) and optionally a router.

    A context manager: leaving it stops the router, then every replica.
    ``policy=None`` starts no router (:meth:`route` starts one later; the
    benchmark swaps routers over the same replicas).
    """

    replicas_n: int
    workdir: Path
    serve_args: Sequence[str] = ()
    policy: str | None = "cache_aware"
    host: str = "127.0.0.1"
    router_port: int = 0
    start_timeout: float = 300.0
    threads: int | None = None
    """BLAS threads per replica (None: the library's default, one per core)."""
    pin: bool = False
    """Pin each replica to its share of this process's cores (:func:`replica_cpus`)."""
    balance: tuple[float, float] | None = None
    """The routers' balance thresholds (:meth:`Router.start`)."""
    keep_ssd: bool = True
    """False: :meth:`stop` removes the SSD directories this launcher made once their replica exited."""
    replicas: list[Replica] = field(default_factory=list)
    router: Router | None = None
    exit_codes: list[int | None] = field(default_factory=list)
    removed_ssd_bytes: int = 0
    """What :meth:`stop` removed with ``keep_ssd=False``."""

    def start(self) -> Cluster:
        """Start every replica, wait for all of them, then the router (if a policy is set)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            cores = sorted(os.sched_getaffinity(0))
            self.replicas = [
                Replica.start(i, self.workdir, self.serve_args, host=self.host,
                              threads=self.threads,
                              cpus=replica_cpus(i, self.replicas_n, cores) if self.pin else None)
                for i in range(self.replicas_n)]
            for r in self.replicas:
                r.wait_ready(self.start_timeout)
            if self.policy is not None:
                self.route(self.policy, port=self.router_port)
        except BaseException:
            self.stop()
            raise
        return self

    def route(self, policy: str, *, port: int = 0) -> Router:
        """Put a router for ``policy`` in front of the replicas (stopping the current one)."""
        if self.router is not None:
            self.router.stop()
        self.router = None
        model = _flag(self.serve_args, "--model")
        self.router = Router.start(policy, self.replicas, self.workdir, host=self.host,
                                   port=port, model=model, balance=self.balance)
        return self.router

    @property
    def url(self) -> str:
        """The router's base URL (no ``/v1``)."""
        assert self.router is not None, "no router started"
        return self.router.url

    def stop(self) -> list[int | None]:
        """Stop the router, then every replica (in parallel); their exit statuses."""
        if self.router is not None:
            self.router.stop()
            self.router = None
        codes: list[int | None] = [None] * len(self.replicas)

        def one(i: int) -> None:
            codes[i] = self.replicas[i].stop()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(self.replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.exit_codes = codes
        if not self.keep_ssd:
            self._remove_ssd()
        return codes

    def _remove_ssd(self) -> None:
        # NOTE: a benchmark's replicas write 7-20 GB of SSD tier a run; a sweep
        # that kept them filled this box's disk. Only directories this launcher
        # named, only once their replica has exited (it holds the lock until then).
        for r in self.replicas:
            if r.ssd_dir is None or r.proc.poll() is None or not r.ssd_dir.exists():
                continue
            self.removed_ssd_bytes += sum(f.stat().st_size for f in r.ssd_dir.rglob("*") if f.is_file())
            shutil.rmtree(r.ssd_dir)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _flag(args: Sequence[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: start the cluster, print the router URL, stop on SIGINT/SIGTERM."""
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="kvtier serve replicas (default 2)")
    p.add_argument("--policy", default="cache_aware",
                   choices=[*SGLANG_POLICIES, *EVENT_POLICIES],
                   help="router policy (default cache_aware; events_prefill: the event router "
                        "with --rule prefill)")
    p.add_argument("--host", default="127.0.0.1", help="address of the router and the replicas")
    p.add_argument("--port", type=int, default=8000, help="the router's port (default 8000)")
    p.add_argument("--workdir", type=Path, default=Path("kvtier-cluster"),
                   help="replica SSD directories and logs (default ./kvtier-cluster)")
    p.add_argument("--threads", type=int, default=None,
                   help="BLAS threads per replica (default: the library's, one per core)")
    p.add_argument("--pin", action="store_true",
                   help="pin each replica to its share of the cores (one core each when there "
                        "are enough; else replicas share cores in turn)")
    p.add_argument("--balance-abs-threshold", type=float, default=None,
                   help="sglang-router's balance rule for cache_aware and events alike "
                        "(default: theirs, 64)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="with --balance-abs-threshold (default 1.5)")
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    balance = (None if args.balance_abs_threshold is None
               else (args.balance_abs_threshold, args.balance_rel_threshold))
    cluster = Cluster(args.replicas, args.workdir.resolve(), serve_args, args.policy,
                      host=args.host, router_port=args.port, threads=args.threads,
                      pin=args.pin, balance=balance)
    with cluster:
        for r in cluster.replicas:
            print(f"replica {r.index}: {r.url} (kv events {r.kv_events}, replay {r.kv_replay})")
        print(f"router ({args.policy}): {cluster.url}/v1", flush=True)
        while not stop.wait(0.5):
            dead = [r.index for r in cluster.replicas if r.proc.poll() is not None]
            if dead or (cluster.router is not None and cluster.router.proc.poll() is not None):
                print(f"a child exited (replicas {dead}); stopping", file=sys.stderr)
                break
    bad = [c for c in cluster.exit_codes if c != 0]
    print(f"stopped; replica exit statuses {cluster.exit_codes}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
