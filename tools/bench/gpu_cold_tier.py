"""Restore from the SSD tier vs recompute, at long contexts on one device (issue #8).

Builds a random-weight model of a real shape, prefills a ``--tokens`` long
prompt (chunked like the engine), stores its KV with kvtier's codec through
the real file port (fsync, rename, directory fsync), then times, per round:

- recompute: a fresh cache, chunked prefill of ``tokens`` prompt tokens, then
  the first token of a ``--suffix``-token suffix (16; what a miss costs);
- restore: drop the file from the page cache (``posix_fadvise(DONTNEED)``),
  then the product's path as a request sees it: ``read_header`` +
  ``open_file``, the reader's pass (``OpenEntry.pass_over``, every tensor's
  xxh3 checked) started on a worker thread and the turn granted at once:
  ``land_entry`` on two landing threads right behind the pass (the bytes
  read straight into MLX arrays and hashed again there), then the same
  suffix's first token (what a cold-tier hit costs).

Rounds alternate the order. The restore-or-recompute estimator
(``actors.ssd_writer.core.Estimator``) is fed what each round measured
(the pass's bytes and seconds, the landing's tail after the pass, prefill
tokens and seconds), as the server feeds it, and asked for its advice for the next round;
the script reports whether the advice picked the faster path each time.
Runs for ``--kv bf16`` and ``--kv 4`` (mlx-lm's affine 4-bit KV, group 64).

Usage: python tools/bench/gpu_cold_tier.py --shape llama3-8b --tokens 32768 --dir /tmp/kvt
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _restore import land_behind_pass
from gpu_engine import SHAPES, build_model
from mlx_lm.models.cache import make_prompt_cache

from actors.ssd_writer.core import Estimator
from kernels.cache import (
    KvFileWriter,
    LandingPool,
    OsFilePort,
    convert_caches,
    open_file,
    plan_entry,
    read_header,
    resolve_kv_scheme,
    tensor_bytes,
)

STEP = 2048


def prefill(model, tokens: list[int], scheme) -> list:  # type: ignore[no-untyped-def]
    cache = make_prompt_cache(model)
    for s in range(0, len(tokens), STEP):
        model(mx.array(tokens[s : s + STEP])[None], cache=cache)
        if scheme is not None:
            convert_caches(cache, scheme)
        mx.eval([c.state for c in cache])
    return cache


def first_token(model, cache, suffix: list[int]) -> int:  # type: ignore[no-untyped-def]
    logits = model(mx.array(suffix)[None], cache=cache)[:, -1, :]
    return int(mx.argmax(logits, axis=-1).item())


def drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def restore(port: OsFilePort, path: str, pool: LandingPool) -> tuple[list[Any], float, float]:
    """The product's restore: open, the reader's pass on a worker, the landing at once behind it.

    The caches, the seconds to the end of the pass, the seconds from then to
    the end of the landing (what the server reports to its estimator).
    """
    t0 = time.perf_counter()
    header = read_header(port, path)
    entry = open_file(port, path, header, verify=True)
    caches, ended = land_behind_pass(entry, pool)
    done = time.perf_counter()
    return caches, ended - t0, max(0.0, done - ended)


def run(
    model: Any,
    tokens: list[int],
    suffix: list[int],
    kv: str,
    directory: str,
    rounds: int,
    group: int,
) -> None:
    scheme = None if kv == "bf16" else resolve_kv_scheme(kv, group_size=group)
    port = OsFilePort()
    cache = prefill(model, tokens, scheme)
    plan = plan_entry(
        cache,
        model_id="bench",
        fingerprint="bench",
        namespace="",
        tokenizer_hash="bench",
        tokens=tokens,
    )
    t0 = time.perf_counter()
    writer = KvFileWriter(port, plan)
    writer.begin(directory)
    for i in range(len(plan.tensors)):
        writer.write_tensor(i, tensor_bytes(plan, i))
    path = os.path.join(directory, f"bench-{kv}.kvt")
    writer.commit(path)
    store_s = time.perf_counter() - t0
    size = os.path.getsize(path)
    print(
        f"## kv={kv}: {len(tokens)} tokens, file {size / 1e9:.2f} GB, store (read-back + write + fsync) "
        f"{store_s:.2f} s = {size / store_s / 1e9:.2f} GB/s",
        flush=True,
    )
    ref = first_token(model, cache, suffix)
    del cache, plan, writer
    mx.clear_cache()
    est = Estimator()
    res: dict[str, list[float]] = {"recompute": [], "restore": [], "read": [], "land_tail": []}
    pool = LandingPool(2)
    right = 0
    asked = 0
    for r in range(rounds):
        advice = est.choose(size, len(tokens))[0]
        order = ("recompute", "restore") if r % 2 == 0 else ("restore", "recompute")
        took: dict[str, float] = {}
        for what in order:
            if what == "recompute":
                t = time.perf_counter()
                c = prefill(model, tokens, scheme)
                t_pref = time.perf_counter() - t
                tok = first_token(model, c, suffix)
                took[what] = time.perf_counter() - t
                est.observe_prefill(len(tokens), t_pref)
            else:
                drop_page_cache(path)
                t = time.perf_counter()
                c, t_read, t_tail = restore(port, path, pool)
                tok = first_token(model, c, suffix)
                took[what] = time.perf_counter() - t
                res["read"].append(t_read)
                res["land_tail"].append(t_tail)
                est.observe_read(size, t_read)
                est.observe_landing(size, t_tail)
            assert tok == ref, f"{what} gave token {tok}, expected {ref}"
            res[what].append(took[what])
            del c
            mx.clear_cache()
        faster = "restore" if took["restore"] < took["recompute"] else "recompute"
        if r > 0:  # the first round's advice is the uninformed default
            asked += 1
            right += advice == faster
        print(
            f"round {r}: recompute {took['recompute'] * 1e3:8.1f} ms  restore {took['restore'] * 1e3:8.1f} ms "
            f"(pass {res['read'][-1] * 1e3:.1f} ms, landing tail {res['land_tail'][-1] * 1e3:.1f} ms)  advice before round: {advice}, faster: {faster}",
            flush=True,
        )
    for k, v in res.items():
        print(
            f"{kv} {k:10s} median {statistics.median(v) * 1e3:9.1f} ms  [{min(v) * 1e3:.1f}..{max(v) * 1e3:.1f}]"
        )
    print(
        f"{kv} restore/recompute {statistics.median(res['restore']) / statistics.median(res['recompute']):.3f}; "
        f"read {size / statistics.median(res['read']) / 1e9:.2f} GB/s; advice right {right}/{asked}"
    )
    pool.close()
    os.unlink(path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--dir", default="/tmp/kvtier-bench")
    p.add_argument("--kv", default="bf16,4")
    p.add_argument("--group", type=int, default=64)
    p.add_argument(
        "--suffix",
        type=int,
        default=16,
        help="tokens after the stored prefix (MLX 0.32's CUDA quantized_matmul refused 16 against 4-bit KV)",
    )
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    model, nb = build_model(a.shape, 49152, 0, mx.bfloat16)
    print(
        f"# {a.shape}: {nb:.2f} B params, device {mx.default_device()}, mlx {mx.__version__}",
        flush=True,
    )
    tokens = [(i * 7919) % 49000 + 10 for i in range(a.tokens)]
    suffix = [(i * 104729) % 49000 + 10 for i in range(a.suffix)]
    for kv in a.kv.split(","):
        run(model, tokens, suffix, kv, a.dir, a.rounds, a.group)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
