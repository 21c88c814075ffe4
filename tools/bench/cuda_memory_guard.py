"""The memory guard on a CUDA card that another process shares (a diagnosis, CUDA only).

Two parts, each printed as it runs and written to ``--json``:

1. ``probe``: what MLX's ``device_info()`` reports (total and free memory)
   as this process allocates and frees 4 GiB, and while a child process
   holds ``--hog-gb`` GiB: whether the free figure is fresh, and whether
   MLX's frees (``mx.clear_cache``) come back to it.
2. ``serve``: for this tree and, with ``--baseline-tree``, another
   checkout, ``kvtier serve`` on ``--model`` (SSD tier off, warm-up off):
   one request, then a child grabs the device's free memory but
   ``--leave-mb``, then ``--requests`` concurrent completions of
   ``--prompt-tokens`` tokens; then the child lets go and one more request
   runs. Each answer's status and error code are recorded: a guard that
   sees the other process answers 503 ``memory_pressure`` (or serves the
   request once it fits); one that does not lets the step fail out of
   device memory.

Run on the device from the repository root, on the model ``gpu_serving.sh``
writes: ``python3 tools/bench/cuda_memory_guard.py --model DIR --tok-dir
.gpu/tok --baseline-tree /tmp/base --json $OUT/cuda_memory_guard.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _common import REPO, Server, child_env, machine

GIB = 1 << 30
MIB = 1 << 20

_HOG = textwrap.dedent("""
    import sys, mlx.core as mx
    leave, cap = int(sys.argv[1]), int(sys.argv[2])
    held, chunk = [], 1 << 30
    def free():
        return int(mx.device_info()["free_memory"])
    while free() - chunk > leave and len(held) * chunk < cap:
        a = mx.zeros((chunk // 2,), dtype=mx.bfloat16)
        mx.eval(a)
        held.append(a)
    chunk = 64 << 20
    while free() - chunk > leave and len(held) * (1 << 30) < cap:
        a = mx.zeros((chunk // 2,), dtype=mx.bfloat16)
        mx.eval(a)
        held.append(a)
    print(f"held {sum(a.nbytes for a in held)} free {free()}", flush=True)
    sys.stdin.readline()
""")


def _info() -> dict[str, int]:
    import mlx.core as mx

    info = mx.device_info()
    return {"total": int(info["total_memory"]), "free": int(info["free_memory"]),
            "mlx_active": int(mx.get_active_memory()), "mlx_cache": int(mx.get_cache_memory())}


class Hog:
    """A child process holding the device's free memory but ``leave`` bytes (at most ``cap``)."""

    def __init__(self, leave: int, cap: int, tree: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOG, str(leave), str(cap)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=child_env(), cwd=tree)
        assert self.proc.stdout is not None
        self.line = self.proc.stdout.readline().strip()

    def release(self) -> None:
        """Let go (the child exits) and wait for it."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def probe(hog_gb: float) -> dict[str, Any]:
    """device_info's figures through an allocation, a free, and another process's hold."""
    import mlx.core as mx

    steps: dict[str, Any] = {"start": _info()}
    a = mx.zeros((2, GIB), dtype=mx.bfloat16)
    mx.eval(a)
    steps["after_alloc_4gib"] = _info()
    del a
    steps["after_free"] = _info()
    mx.clear_cache()
    steps["after_clear_cache"] = _info()
    mx.synchronize()
    steps["after_synchronize"] = _info()
    hog = Hog(0, int(hog_gb * GIB), REPO)
    steps["hog"] = hog.line
    steps["while_child_holds"] = _info()
    hog.release()
    steps["after_child_exits"] = _info()
    for name, figures in steps.items():
        if isinstance(figures, dict):
            used = (figures["total"] - figures["free"]) / GIB
            print(f"probe {name:>20}: device used {used:6.2f} GiB, free {figures['free'] / GIB:6.2f}, "
                  f"MLX active {figures['mlx_active'] / GIB:5.2f} cache {figures['mlx_cache'] / GIB:5.2f}",
                  flush=True)
    return steps


def _complete(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One completion (not streamed): its status and, for an error, the body's code and message."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    t0 = time.perf_counter()
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    out: dict[str, Any] = {"status": resp.status_code, "s": round(time.perf_counter() - t0, 3)}
    try:
        obj = resp.json()
    except ValueError:
        out["body"] = resp.text[:300]
        return out
    error = obj.get("error") if isinstance(obj, dict) else None
    if error:
        out["code"] = error.get("code") or error.get("type")
        out["message"] = str(error.get("message"))[:300]
    else:
        out["tokens"] = obj["usage"]["completion_tokens"]
    return out


def serve(name: str, tree: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One server from ``tree``: a request, the hog, concurrent requests, the hog gone, a request."""
    # NOTE: the tree first, then what this process finds (the device's installed wheels).
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-P", "-m", "actors.cli", "serve", "--model", str(args.model),
           "--port", "0", "--ssd-cache", "off", "--warm-up", "off", "--max-batch", "8"]
    server = Server(cmd, work, name, env)
    server.wait_ready(None, 300.0)
    url = server.url
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    rec: dict[str, Any] = {"tree": str(tree)}
    try:
        rec["before"] = _complete(url, model, list(range(100, 164)), 16)
        hog = Hog(int(args.leave_mb * MIB), int(args.hog_cap_gb * GIB), tree)
        rec["hog"] = hog.line
        answers: list[dict[str, Any]] = [{} for _ in range(args.requests)]

        def one(i: int) -> None:
            prompt = [(7919 * (i + 1) * (j + 3)) % 30000 + 100 for j in range(args.prompt_tokens)]
            answers[i] = _complete(url, model, prompt, args.max_tokens)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rec["while_held"] = answers
        rec["memory_while_held"] = httpx.get(f"{url}/stats", timeout=10).json()["engine"].get("memory")
        hog.release()
        rec["after"] = _complete(url, model, list(range(200, 264)), 16)
        rec["alive"] = server.proc.poll() is None
    finally:
        server.stop()
    print(f"serve {name}: before {rec['before']['status']}, {rec['hog']}", flush=True)
    for i, answer in enumerate(rec["while_held"]):
        print(f"serve {name}: held request {i}: {answer}", flush=True)
    print(f"serve {name}: after {rec['after']}, server alive {rec['alive']}", flush=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--baseline-tree", type=Path, default=None)
    p.add_argument("--hog-gb", type=float, default=8.0, help="what the probe's child holds")
    p.add_argument("--leave-mb", type=float, default=512.0, help="free memory the serve part's child leaves")
    p.add_argument("--hog-cap-gb", type=float, default=1024.0)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    record: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    record["probe"] = probe(args.hog_gb)
    work = Path(tempfile.mkdtemp(prefix="kvtier-cuda-guard-"))
    record["serve"] = {"this": serve("this", REPO, args, work)}
    if args.baseline_tree is not None:
        record["serve"]["baseline"] = serve("baseline", args.baseline_tree.resolve(), args, work)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
