"""Per-token cost of constrained decoding (structured output) on the default model, on this CPU.

Decodes the same chat prompt greedily, unconstrained and under a JSON
schema, with each constrained-decoding library that installs here as an
mlx-lm logits processor:

* **llguidance** (what kvtier uses: ``kernels.engine.GrammarProcessor``);
* **outlines-core** (a processor over its ``Guide``, written here the same
  way: the allowed-token list becomes a boolean mask, applied with
  ``mx.where``).

xgrammar is not measured: its wheel imports ``torch`` at import time, and
``pip install xgrammar`` pulls torch with the CUDA wheels (gigabytes) onto a
CPU machine.

Only decode steps are timed (the prefill and the first decode step, which
forwards the last prompt token, are left out); runs are interleaved and
repeated, and the median step is reported. The schema keeps the constrained
output going (an array of at least 200 short strings), so every run decodes
``--tokens`` steps. Setup costs (the library's view of the tokenizer,
compiling the schema) are reported separately: kvtier pays them on a worker
thread before admission, once per tokenizer and per schema. Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/structured_overhead.py [--tokens 96] [--repeats 5]

Prints the median step time of each, the processor's own time per step
(the mask: llguidance's Rust plus the ``mx.where``), and the step overhead
(constrained step / plain step − 1, median over repeats, each repeat running
the contenders back to back); the target is <= 5 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kernels import Generation, SamplingParams, ensure_default_model, load_model, render_chat
from kernels.engine import GrammarProcessor, TokenBytes, json_schema_grammar, prepare_grammar

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer"},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 200},
    },
    "required": ["title", "year", "notes"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Describe a famous film as JSON: its title, year and many short notes."}]

Processor = Callable[[mx.array, mx.array], mx.array]


class _Timed:
    """Wraps a processor and records the time of each call, not counting the wait for the token.

    NOTE: a grammar must know the token just sampled before it can mask the
    next one, so each call first waits for the previous forward to finish;
    an unconstrained step waits for the same token a moment later (to read
    it), so that wait is not the processor's cost and is left out here.
    """

    def __init__(self, inner: Processor) -> None:
        self.inner = inner
        self.calls: list[float] = []

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        mx.eval(history)
        t0 = time.perf_counter()
        out = self.inner(history, logits)
        self.calls.append(time.perf_counter() - t0)
        return out


class OutlinesProcessor:
    """outlines-core's Guide as an mlx-lm logits processor (same shape as kvtier's)."""

    def __init__(self, index: Any) -> None:
        import outlines_core

        self._guide = outlines_core.Guide(index)
        self._primed = False

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if self._primed:
            self._guide.advance(int(history[-1].item()))  # type: ignore[arg-type]
        self._primed = True
        allowed = np.zeros(int(logits.shape[-1]), dtype=np.bool_)
        allowed[self._guide.get_tokens()] = True
        return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))


def _outlines_index(tok: Any, vocab: int) -> Any:
    """outlines-core's index of SCHEMA over the tokenizer's vocabulary (token bytes → ids)."""
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    spell = TokenBytes(tok)
    eos = min(tok.eos_token_ids)
    special = set(getattr(tok._tokenizer, "added_tokens_decoder", {}) or {})
    table: dict[bytes, list[int]] = {}
    for token_id, raw in enumerate(spell(range(vocab))):
        if token_id == eos or token_id in special or not raw:
            continue
        table.setdefault(raw, []).append(token_id)
    vocabulary = outlines_core.Vocabulary(eos, table)
    return outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)


def _decode_steps(model: Any, tok: Any, prompt: list[int], tokens: int,
                  params: SamplingParams, extra: list[Processor]) -> tuple[list[float], str]:
    """Per-step seconds of one greedy run (first decode step left out), and the text."""
    gen = Generation(model, tok, prompt, params)
    # NOTE: the bench's own processor (outlines) joins the same chain kvtier's would.
    gen._processors.extend(extra)
    if extra and gen._history is None:
        gen._history = mx.array(prompt)
    while not gen.prefill_step():
        pass
    steps: list[float] = []
    text: list[str] = []
    for i in range(tokens):
        t0 = time.perf_counter()
        out = gen.decode_step()
        if i:
            steps.append(time.perf_counter() - t0)
        text.append(out.text)
        if out.finish_reason is not None:
            break
    return steps, "".join(text)


def main() -> None:
    """Measure and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="mlx-lm model directory (default model)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-outlines", action="store_true",
                    help="leave outlines-core out (its index takes minutes to build on a loaded box)")
    args = ap.parse_args()

    path = args.model or ensure_default_model()
    loaded = load_model(path)
    model, tok = loaded.model, loaded.tokenizer
    vocab = int(model.args.vocab_size)
    prompt = render_chat(tok, PROMPT)
    print(f"model {path.name}, vocab {vocab}, prompt {len(prompt)} tokens, {args.tokens} decode steps, "
          f"{args.repeats} interleaved repeats", flush=True)

    t0 = time.perf_counter()
    grammar = json_schema_grammar(SCHEMA)
    prepare_grammar(tok, grammar, vocab)
    llg_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    prepare_grammar(tok, json_schema_grammar({**SCHEMA, "title": "another"}), vocab)
    llg_compile = time.perf_counter() - t0

    outlines_setup: float | None = None
    index: Any = None
    if not args.skip_outlines:
        try:
            t0 = time.perf_counter()
            index = _outlines_index(tok, vocab)
            outlines_setup = time.perf_counter() - t0
        except ImportError as exc:
            print(f"outlines-core not measured: {exc}")

    # NOTE: each repeat runs the three back to back and is compared within
    # itself (the ratio of its medians), so a load change between repeats on
    # a shared machine moves all three together.
    steps: dict[str, list[float]] = {"plain": [], "llguidance": [], "outlines-core": []}
    ratios: dict[str, list[float]] = {"llguidance": [], "outlines-core": []}
    calls: dict[str, list[float]] = {"llguidance": [], "outlines-core": []}
    sample: dict[str, str] = {}
    plain = SamplingParams(max_tokens=args.tokens)
    for _ in range(args.repeats):
        s, sample["plain"] = _decode_steps(model, tok, prompt, args.tokens, plain, [])
        steps["plain"] += s
        base_r = statistics.median(s)
        runs: list[tuple[str, Processor]] = [("llguidance", GrammarProcessor(tok, grammar))]
        if index is not None:
            runs.append(("outlines-core", OutlinesProcessor(index)))
        for name, proc in runs:
            timed = _Timed(proc)
            s, sample[name] = _decode_steps(model, tok, prompt, args.tokens, plain, [timed])
            steps[name] += s
            ratios[name].append(statistics.median(s) / base_r)
            calls[name] += timed.calls[2:]

    base = statistics.median(steps["plain"])
    print(f"\n{'decoding':<15}{'step ms':>10}{'processor ms':>14}{'processor %':>13}"
          f"{'step overhead %':>17}")
    print(f"{'plain':<15}{base * 1e3:>10.2f}{'-':>14}{'-':>13}{'-':>17}")
    for name in ("llguidance", "outlines-core"):
        if not steps[name]:
            continue
        med = statistics.median(steps[name])
        proc = statistics.median(calls[name])
        overhead = (statistics.median(ratios[name]) - 1) * 100
        print(f"{name:<15}{med * 1e3:>10.2f}{proc * 1e3:>14.3f}{proc / base * 100:>13.2f}"
              f"{overhead:>17.1f}")
    print("(medians; processor % = the processor's own time per step / the plain step; "
          "step overhead % = median over repeats of constrained step / plain step - 1)")
    print(f"\nsetup: llguidance tokenizer + first schema {llg_setup:.2f} s, another schema "
          f"{llg_compile * 1e3:.1f} ms" + (f"; outlines-core vocabulary + index {outlines_setup:.2f} s"
                                          if outlines_setup is not None else ""))
    for name, text in sample.items():
        print(f"sample {name}: {text[:90]!r}")


if __name__ == "__main__":
    main()
