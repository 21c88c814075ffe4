"""A start-up pass through the batch lane's kinds of step, so that MLX compiles its kernels then.

MLX's CUDA backend compiles some kernels with NVRTC the first time a process
uses them (gathers per value and index type, the fused element-wise graphs of
``mx.compile``): compiled per kind, not per shape, and kept on disk
(``MLX_PTX_CACHE_DIR``, by default ``/tmp/mlx/<version>/ptx``). On a fresh
machine or container each compile took 3-7 s on an H100, inside the steps of
the first requests: a first request's join step took 3.4 s, and the first
join of rows over cached prefixes 3.0-4.6 s against ~0.2 s once compiled
(docs/benchmarks.md, 2026-12-06 14:36). :func:`warm_up` runs those kinds of
step with prompts of a few dozen tokens before the server says it is ready:
a cold row with a prompt-boundary snapshot, then rows of ragged suffixes
over lent prefixes of two lengths, greedy and sampled (with log-probs),
joining beside a decoding row, every row to its end.

Engine thread only; nothing it builds outlives the call (its registry entry
is disposed, its batch closed).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from kernels.cache import CacheRegistry, KvScheme

from ._batch import BatchGeneration, RowExit, model_batch_gate
from ._sampling import SamplingParams

__all__ = ["WarmUpFailed", "WarmUpReport", "warm_up"]

_TEXT = "The quick brown fox jumps over the lazy dog while the cache warms up. "
_PROMPT = 48
"""The cold row's prompt tokens: its snapshot point and the lent prefixes sit inside it."""
_MAX_STEPS = 256
"""A bound the pass never reaches (every row has a fixed length): a loop that runs away fails."""


class WarmUpFailed(RuntimeError):
    """The pass did not run its rows to their ends within its step bound."""


@dataclass(frozen=True, slots=True)
class WarmUpReport:
    """What :func:`warm_up` ran: ``skipped`` names why it ran nothing (the batch lane's refusal
    of this model), else the steps, rows, rows joined over a lent prefix, and its seconds."""

    skipped: str | None
    steps: int = 0
    rows: int = 0
    warm_rows: int = 0
    snapshots: int = 0
    seconds: float = 0.0


def _token_ids(tokenizer: Any, n: int) -> list[int]:
    """``n`` token ids of plain text (the tokenizer's own ids, none of them special)."""
    ids = [int(t) for t in tokenizer.encode(_TEXT, add_special_tokens=False)]
    if not ids:
        raise ValueError("the tokenizer encoded the warm-up text as no tokens")
    return list(itertools.islice(itertools.cycle(ids), n))


def _run(batch: BatchGeneration, until: set[str], exits: dict[str, RowExit], counts: list[int],
         *, steps: int | None = None) -> None:
    """Step ``batch`` until every row of ``until`` left (or ``steps`` steps ran); keep the exits;
    count steps and snapshots in ``counts``."""
    ran = 0
    while not until <= exits.keys() and (steps is None or ran < steps):
        if counts[0] >= _MAX_STEPS:
            raise WarmUpFailed(f"rows {sorted(until - exits.keys())} still held after {_MAX_STEPS} steps")
        out = batch.step()
        ran += 1
        counts[0] += 1
        counts[1] += len(out.snapshots)
        for e in out.exits:
            exits[e.row_id] = e


def warm_up(
    model: Any,
    tokenizer: Any,
    *,
    kv_scheme: KvScheme | None = None,
    prefill_step_size: int = 2048,
) -> WarmUpReport:
    """Run the batch lane's kinds of step once with short prompts (engine thread).

    Raises :class:`WarmUpFailed` if the rows do not end; a model the batch
    lane refuses runs nothing (``skipped``).
    """
    gate = model_batch_gate(model, kv_scheme)
    if not gate.batchable:
        return WarmUpReport(skipped=gate.refusal or "not batchable")
    began = time.perf_counter()
    ids = _token_ids(tokenizer, _PROMPT + 32)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    batch = BatchGeneration(model, tokenizer, max_rows=4, prefill_step_size=prefill_step_size,
                            kv_scheme=kv_scheme)
    registry = CacheRegistry(prefix="warm")
    counts = [0, 0]
    exits: dict[str, RowExit] = {}
    try:
        # NOTE: a cold row with a snapshot point inside its prompt (the chat
        # rows' prompt-boundary snapshot), run to its end: its cache is lent next.
        batch.join("cold", ids[:_PROMPT], greedy, snapshot_at=_PROMPT - 8)
        _run(batch, {"cold"}, exits, counts)
        lent = exits["cold"]
        entry = registry.register(lent.cache, offset=len(lent.cache_tokens))
        handle, meta = entry.handle, entry.meta
        # NOTE: the served agent turn: rows whose suffixes differ in length
        # join over cached prefixes of different lengths, one sampled with
        # log-probs, beside a row that is decoding.
        batch.join("decoding", ids[8:40], SamplingParams(max_tokens=12, ignore_eos=True))
        _run(batch, {"decoding"}, exits, counts, steps=2)
        sampled = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=20,
                                 seed=0, logprobs=True, top_logprobs=2)
        warm = {"warm-a": (40, 7, greedy), "warm-b": (44, 12, sampled)}
        for rid, (want, new, params) in warm.items():
            # NOTE: an entry that cannot be shortened (recurrent state, a ring
            # past its window) is lent whole, as the prompt cache would.
            cached = want if meta.trimmable and want >= meta.min_reusable_offset else meta.offset
            prompt = list(lent.cache_tokens[:cached]) + ids[_PROMPT : _PROMPT + new]
            batch.join(rid, prompt, params, cache=registry.materialize(handle, cached),
                       cached_tokens=cached)
        _run(batch, {"decoding", *warm}, exits, counts)
        registry.dispose(handle)
        registry.drain()
    finally:
        batch.close()
    return WarmUpReport(skipped=None, steps=counts[0], rows=len(exits),
                        warm_rows=sum(1 for rid in warm if exits[rid].cached_tokens > 0),
                        snapshots=counts[1], seconds=time.perf_counter() - began)
