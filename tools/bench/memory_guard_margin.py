"""How close a request's RSS growth comes to the memory guard's projection (its stated margin's evidence).

For each request on a real ``kvtier serve``: the guard's reading before it
(``/stats`` ``engine.memory.active_bytes``: RSS), the footprint the guard
projects for it (``Footprint.at_prefill`` with the model's shape), and the
peak of the server's ``VmRSS`` while it runs (sampled every 2 ms). The
excess, peak - (reading + footprint), must stay under the stated margin
(MLX cache limit + 32 MiB); docs/operations.md ("Memory-pressure guard")
records the figures. Linux only (reads ``/proc``).

    python tools/bench/memory_guard_margin.py wide      # the e2e test's memory-shaped model
    python tools/bench/memory_guard_margin.py default   # SmolLM2-135M-Instruct, float32
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from actors.engine_thread.memory_guard import Footprint  # noqa: E402
from tests.e2e.server_process import ServerProcess  # noqa: E402
from tests.e2e.test_memory_guard_rss import RssSampler, _wide_model  # noqa: E402

MIB = 1 << 20


def _setup(which: str, root: Path) -> tuple[Path, Footprint, list[int]]:
    if which == "wide":
        from kernels import convert_gguf
        from tests.model_fixtures import tiny_llama_gguf

        tiny_llama_gguf(root / "tiny.gguf")
        tiny = convert_gguf(root / "tiny.gguf", root / "tiny-mlx", dequantize=True)
        model = _wide_model(tiny, root / "wide")
        footprint = Footprint(kv_bytes_at=lambda n: n * 128 * 1024, chunk=512, hidden=64,
                              intermediate=128, heads=16, dtype_bytes=4)
        return model, footprint, [10, 100, 250, 300, 520, 700, 1000]
    from kernels import ensure_default_model

    model = ensure_default_model()
    # NOTE: SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 64 x 4 bytes a token.
    footprint = Footprint(kv_bytes_at=lambda n: n * 30 * 2 * 3 * 64 * 4, chunk=512, hidden=576,
                          intermediate=1536, heads=9, dtype_bytes=4)
    return model, footprint, [10, 300, 600, 1100, 1600, 2100]


def main() -> None:
    """Run the workload twice (the second pass hits the RAM tier) and print each request's excess."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["wide", "default"])
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtier-margin-"))
    try:
        model, footprint, lengths = _setup(args.model, root)
        (root / "w").mkdir()
        server = ServerProcess(root / "w", "--model", str(model), "--prompt-cache", "1",
                               "--prefill-step-size", "512")
        worst: float | None = None
        try:
            with httpx.Client(base_url=server.url, timeout=600) as client:
                for rep in range(2):
                    for n in lengths:
                        for stream in (False, True):
                            prompt = [3 + (i * (rep + 2) + n) % 90 for i in range(n)]
                            body = {"prompt": prompt, "max_tokens": args.max_tokens,
                                    "stream": stream}
                            memory = client.get("/stats").json()["engine"]["memory"]
                            reading = memory["active_bytes"]
                            sampler = RssSampler(server.proc.pid)
                            with client.stream("POST", "/v1/completions", json=body) as r:
                                for _ in r.iter_lines():
                                    pass
                            time.sleep(0.02)
                            peak = sampler.stop()
                            demand = footprint.at_prefill(n, args.max_tokens)
                            excess = (peak - reading - demand) / MIB
                            worst = excess if worst is None else max(worst, excess)
                            print(f"prompt {n:5d} stream {stream!s:5} reading "
                                  f"{reading / MIB:7.1f} footprint {demand / MIB:6.1f} grew "
                                  f"{(peak - reading) / MIB:6.1f} excess {excess:7.1f} MiB",
                                  flush=True)
                print(f"worst excess {worst:.1f} MiB; stated margin "
                      f"{memory['margin_bytes'] / MIB:.0f} MiB")
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
