"""``kvtier serve`` from several commits side by side: paired HTTP decode rates, interleaved.

Each ``--commit`` is extracted with ``git archive`` into a temporary tree and
served from there (``python -m actors.cli serve`` with that tree as the working
directory and first on ``PYTHONPATH``, the same interpreter and packages for
all), every server up at once; ``--mlx`` adds ``mlx_lm.server``. Each round
sends one streaming chat request (greedy, ``--max-tokens``, a fresh nonce
first, prompt cache off) to every server in turn, the order rotated by one each
round, so a load that drifts over the run reaches every contender alike.
Reported: each contender's median decode rate with its interquartile range, and
the median of the per-round ratios of every contender to the first commit
(pairs measured seconds apart, so they share the machine's load).

NOTE: ``tools/bench/overhead.py`` measures one tree against ``mlx_lm.server``;
on a shared CPU its HTTP ratio moves with ``mlx_lm.server``'s own rate, which
varies far more under load than ``kvtier serve``'s. This script compares
commits directly.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/http_ab.py --commit 6c0eadc --commit HEAD \\
        [--rounds 45] [--max-tokens 64] [--mlx] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import extract_commit, running_server  # noqa: E402
from overhead import _http_sample  # noqa: E402

import kernels  # noqa: E402

_READY_S = 180.0


def _iqr(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def main() -> int:
    """Serve every commit at once, interleave the requests, print medians and paired ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--commit", action="append", required=True,
        help="a commit to serve (repeat; the first is the reference of the ratios)",
    )
    parser.add_argument("--rounds", type=int, default=45, help="requests per contender")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--mlx", action="store_true", help="add mlx_lm.server as a contender")
    parser.add_argument("--json", type=Path, default=None, help="write every sample here")
    args = parser.parse_args()

    model_dir = str(kernels.ensure_default_model())
    py = sys.executable
    decode: dict[str, list[float]] = {}
    ttft: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-http-ab-") as tmp, contextlib.ExitStack() as stack:
        bases: dict[str, str] = {}
        for commit in args.commit:
            short, tree = extract_commit(commit, Path(tmp))
            argv = [py, "-m", "actors.cli", "serve", "--model", model_dir,
                    "--prompt-cache", "0", "--log-level", "warning"]
            # NOTE: the tree's own packages, not this checkout's: it is the
            # working directory and first on PYTHONPATH.
            bases[short] = stack.enter_context(
                running_server(argv, Path(tmp), short, cwd=tree, env={"PYTHONPATH": str(tree)}, timeout=_READY_S)
            )
        if args.mlx:
            argv = [py, "-m", "mlx_lm", "server", "--model", model_dir]
            bases["mlx_lm.server"] = stack.enter_context(
                running_server(argv, Path(tmp), "mlx_lm", env={"PYTHONPATH": str(REPO)}, timeout=_READY_S)
            )
        names = list(bases)
        nonce = 0
        for name in names:  # warm-up: two short answers each
            for _ in range(2):
                nonce += 1
                _http_sample(bases[name], model_dir, nonce, 8)
        decode = {name: [] for name in names}
        ttft = {name: [] for name in names}
        for r in range(args.rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                nonce += 1
                sample = _http_sample(bases[name], model_dir, nonce, args.max_tokens)
                decode[name].append(sample.decode_tps)
                ttft[name].append(sample.ttft_s)
            print(f"round {r}: " + "  ".join(f"{n} {decode[n][-1]:.1f}" for n in names), flush=True)

    ref = names[0]
    print(f"\n# http_ab: max_tokens={args.max_tokens}, rounds={args.rounds}, load {os.getloadavg()[0]:.1f}; "
          f"ratios are medians of per-round pairs against {ref}")
    for name in names:
        lo, hi = _iqr(decode[name])
        ratios = [x / y for x, y in zip(decode[name], decode[ref], strict=True)]
        rlo, rhi = _iqr(ratios)
        print(f"{name:<14} decode {statistics.median(decode[name]):6.1f} tok/s (IQR {lo:.1f}-{hi:.1f})  "
              f"TTFT {statistics.median(ttft[name]) * 1000:7.1f} ms  "
              f"/ {ref} {statistics.median(ratios):.3f} (IQR {rlo:.3f}-{rhi:.3f})")
    if args.json is not None:
        args.json.write_text(json.dumps({"decode_tps": decode, "ttft_s": ttft}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
