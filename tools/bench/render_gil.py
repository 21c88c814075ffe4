"""An agent turn's prompt render beside a thread that holds the GIL: three ways to encode its pieces.

On the GPU host an agent turn's `render` took 13-47 ms (5,162-token chats,
docs/benchmarks.md 2026-12-06 14:36) where an idle box renders it in well
under 5 ms, while the engine thread holds the GIL building its steps. The
question: do the render's calls into the tokenizer (one per piece of the
chat) each leave the GIL and wait to take it back? This renders the next
turn of an agent conversation (the template, then the pieces' token ids,
earlier pieces cached as they are served) three ways, alone and beside a
thread that runs Python without pause, interleaved: ``served`` is
``PieceEncoder.encode`` (the backend's ``encode`` per uncached piece, which
keeps the GIL); ``hf per piece`` Hugging Face's ``encode`` per uncached
piece (what ``PieceEncoder`` did before: it goes through the backend's
``encode_batch``, which leaves the GIL); ``one call`` the uncached pieces in
one ``encode_batch`` call.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 .venv/bin/python \\
        tools/bench/render_gil.py --rounds 40 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.engine._token_cache import _MIN_CACHED_PIECE as MIN_CACHED_PIECE


def _conversation(system_words: int, turns: int, salt: int) -> list[dict[str, str]]:
    """The agent trace's shape: a long system prompt, ``turns`` earlier exchanges, a new question."""
    words = " ".join(f"tool{i % 97} returns field{i % 13} as text;" for i in range(system_words // 5))
    msgs = [{"role": "system", "content": words}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Step {t}: call tool{t} on item {t * 7} and report."})
        msgs.append({"role": "assistant", "content": f"Called tool{t}: item {t * 7} has value {t * 13}."})
    msgs.append({"role": "user", "content": f"Step {turns}: summarize items, case {salt}."})
    return msgs


class _Pieces:
    """Split at the special tokens as ``PieceEncoder`` does; the pieces not seen before through
    Hugging Face's ``encode`` one by one, or (``batch``) in one ``encode_batch`` call of the
    backend. ``calls``: tokenizer calls (each leaves the GIL)."""

    def __init__(self, tok: Any, *, batch: bool) -> None:
        added = tok.added_tokens_decoder
        self._tok = tok
        self._batch = batch
        self._ids = {str(t.content): int(i) for i, t in added.items() if t.special}
        self._pattern = re.compile("|".join(re.escape(t) for t in sorted(self._ids, key=len, reverse=True)))
        self._seen: dict[str, list[int]] = {}
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        parts = [p for p in re.split(f"({self._pattern.pattern})", text) if p]
        new = [p for p in dict.fromkeys(parts) if p not in self._ids and p not in self._seen]
        found: dict[str, list[int]] = {}
        if new and self._batch:
            self.calls += 1
            for piece, e in zip(new, self._tok.backend_tokenizer.encode_batch(new, add_special_tokens=False),
                                strict=True):
                found[piece] = list(e.ids)
        for piece in new if not self._batch else ():
            self.calls += 1
            found[piece] = list(self._tok.encode(piece, add_special_tokens=False))
        # NOTE: PieceEncoder's rule: only long pieces are kept (short ones are encoded every time).
        self._seen |= {p: ids for p, ids in found.items() if len(p) >= MIN_CACHED_PIECE}
        out: list[int] = []
        for p in parts:
            out += [self._ids[p]] if p in self._ids else found.get(p) or self._seen[p]
        return out


class _Hog:
    """A thread that runs Python without pause (the GIL's other holder) until stopped."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        x = 0
        while not self._stop.is_set():
            for i in range(2000):
                x += i * i
        del x

    def __enter__(self) -> _Hog:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--system-words", type=int, default=4400)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="write a PNG of each mode's medians and ranges here")
    args = ap.parse_args()

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    import kernels
    from kernels.engine._token_cache import PieceEncoder

    tok = load_tokenizer(kernels.default_model_dir())
    encoders: dict[str, Any] = {"served": PieceEncoder(tok), "hf per piece": _Pieces(tok, batch=False),
                                "one call": _Pieces(tok, batch=True)}
    assert encoders["served"].direct, "this tokenizer's backend did not pass the piece encoder's check"
    times: dict[str, dict[str, list[float]]] = {m: {"alone": [], "beside": []} for m in encoders}
    calls: dict[str, list[int]] = {m: [] for m in encoders}
    tokens = 0

    def render(mode: str, salt: int) -> float:
        nonlocal tokens
        enc = encoders[mode]
        # NOTE: the earlier turns were served before: their pieces are cached.
        warm = tok.apply_chat_template(_conversation(args.system_words, args.turns, -1),
                                       add_generation_prompt=True, tokenize=False)
        enc.encode(str(warm))
        if hasattr(enc, "calls"):
            enc.calls = 0
        began = time.perf_counter()
        text = tok.apply_chat_template(_conversation(args.system_words, args.turns, salt),
                                       add_generation_prompt=True, tokenize=False)
        ids = enc.encode(str(text))
        took = (time.perf_counter() - began) * 1e3
        tokens = len(ids)
        calls[mode].append(getattr(enc, "calls", -1))
        return took

    salt = 0
    for where in ("alone", "beside"):
        # NOTE: one holder for the whole phase (as the engine thread under load),
        # the modes interleaved, each render after a pause that leaves the GIL.
        with _Hog() if where == "beside" else contextlib.nullcontext():
            for r in range(args.rounds):
                for mode in list(encoders) if r % 2 == 0 else list(reversed(encoders)):
                    salt += 1
                    time.sleep(0.005)
                    times[mode][where].append(render(mode, salt))
    summary: dict[str, Any] = {"tokens": tokens, "rounds": args.rounds,
                               "switch_interval_s": sys.getswitchinterval()}
    print(f"{tokens}-token chat, {args.rounds} rounds, switch interval {sys.getswitchinterval() * 1e3:.0f} ms")
    for mode in encoders:
        row = {w: statistics.median(v) for w, v in times[mode].items()}
        row |= {f"{w}_range": [min(v), max(v)] for w, v in times[mode].items()}
        row["tokenizer_calls"] = statistics.median(calls[mode])
        summary[mode] = row
        print(f"{mode:>12}: render p50 alone {row['alone']:.2f} ms, beside a GIL holder {row['beside']:.2f} ms "
              f"(range {row['beside_range'][0]:.1f}-{row['beside_range'][1]:.1f}); "
              + (f"tokenizer calls {row['tokenizer_calls']:.0f}" if row["tokenizer_calls"] >= 0
                 else "no call leaves the GIL"))
    for mode in ("hf per piece", "one call"):
        ratio = summary["served"]["beside"] / summary[mode]["beside"]
        summary[f"served / {mode}, beside"] = ratio
        print(f"served / {mode}, beside a GIL holder: {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if args.plot:
        _plot(args.plot, summary, list(encoders), tokens)


def _plot(path: Path, summary: dict[str, Any], modes: list[str], tokens: int) -> None:
    """Each mode's render p50 alone and beside a GIL holder, the ranges as error bars (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, where in enumerate(("alone", "beside")):
        mids = [summary[m][where] for m in modes]
        lows = [mid - summary[m][f"{where}_range"][0] for m, mid in zip(modes, mids, strict=True)]
        highs = [summary[m][f"{where}_range"][1] - mid for m, mid in zip(modes, mids, strict=True)]
        xs = [i + (k - 0.5) * width for i in range(len(modes))]
        ax.bar(xs, mids, width, yerr=[lows, highs], capsize=3,
               label="alone" if where == "alone" else "beside a thread holding the GIL")
    ax.set_xticks(range(len(modes)), modes)
    ax.set_yscale("log")
    ax.set_ylabel("render p50, ms (log)")
    ax.set_title(f"next agent turn's render ({tokens}-token chat), CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
