"""Continuous batching kernel (``kernels.BatchGeneration``) against the serial kernel, fp32.

Every row of a batch must produce what the same request produces alone on the
serial lane (``kernels.Generation``): greedy tokens, seeded samples, text,
finish reasons, and a cache that holds exactly the tokens it says it holds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from kernels import (
    Generation,
    InvalidPrompt,
    KvScheme,
    LayerQuant,
    SamplingParams,
    StepOutput,
    clone_caches,
    load_model,
    render_chat,
    run_generation,
)
from kernels.engine import (
    IDLE_PREFILL_ROWS,
    BatchFull,
    BatchGeneration,
    RowExit,
    RowSnapshot,
    UnknownRow,
    batch_gate,
    batch_params_refusal,
    batch_ssm_enabled,
    model_batch_gate,
)
from tests.kernels.test_generation import lively_llama, tiny_tokenizer
from tests.tiny_models import tiny_gemma3, tiny_mamba

# NOTE: a greedy token may differ from the serial lane's only where the two
# best logits are this close (a reduction-order flip, docs/batching.md).
NEAR_TIE = 1e-3


def _lively(build: Any, vocab: int) -> Any:
    model = build(vocab_size=vocab, seed=1, dtype=mx.float32)
    model.update(tree_map(lambda p: p * 2.0, model.parameters()))
    mx.eval(model.parameters())
    return model


def _prompts(vocab: int, n: int, *, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    """``n`` random prompts of distinct lengths in [lo, hi] (ids below the special tokens)."""
    rng = random.Random(seed)
    lengths = rng.sample(range(lo, hi + 1), n)
    return [[rng.randrange(0, vocab - 2) for _ in range(length)] for length in lengths]


def _serial(
    model: Any, tok: Any, prompt: Sequence[int], params: SamplingParams, **kw: Any
) -> list[StepOutput]:
    return run_generation(
        Generation(model, tok, prompt, params, prefill_step_size=kw.pop("step", 16), **kw)
    )


@dataclass
class Plan:
    """One row to join: at step ``join_at`` (or later, once the batch has room)."""

    row_id: str
    prompt: list[int]
    params: SamplingParams
    join_at: int = 0
    cache: list[Any] | None = None
    cached_tokens: int = 0
    snapshot_at: int | None = None
    cancel_after: int | None = None
    """Cancel the row once it has this many tokens."""


@dataclass
class Run:
    """Everything a driven batch produced, per row."""

    outputs: dict[str, list[StepOutput]] = field(default_factory=dict)
    exits: dict[str, RowExit] = field(default_factory=dict)
    snapshots: dict[str, RowSnapshot] = field(default_factory=dict)
    joined_step: dict[str, int] = field(default_factory=dict)
    left_step: dict[str, int] = field(default_factory=dict)
    steps: list[tuple[int, int, int]] = field(default_factory=list)
    """(decode rows, tokens out, prefill tokens) per step."""
    entered: list[int] = field(default_factory=list)
    """Rows that entered the decode batch per step (forwarded their last prompt token, emitted nothing)."""

    def ids(self, row_id: str) -> list[int]:
        return [o.token_id for o in self.outputs[row_id]]

    def text(self, row_id: str) -> str:
        return "".join(o.text for o in self.outputs[row_id])


def drive(batch: BatchGeneration, plans: Sequence[Plan], *, max_steps: int = 2000) -> Run:
    """Join rows per plan, step until every row has left, cancel where planned."""
    run = Run()
    waiting = sorted(plans, key=lambda p: p.join_at)
    by_id = {p.row_id: p for p in plans}
    step = 0
    while waiting or not batch.idle:
        assert step < max_steps, "the batch did not drain"
        while waiting and waiting[0].join_at <= step and len(batch) < batch.max_rows:
            p = waiting.pop(0)
            batch.join(
                p.row_id,
                p.prompt,
                p.params,
                cache=p.cache,
                cached_tokens=p.cached_tokens,
                snapshot_at=p.snapshot_at,
            )
            run.outputs[p.row_id] = []
            run.joined_step[p.row_id] = step
        result = batch.step()
        run.steps.append((result.decode_rows, len(result.tokens), result.prefill_tokens))
        run.entered.append(len(result.joined))
        for t in result.tokens:
            assert t.index == len(run.outputs[t.row_id])
            run.outputs[t.row_id].append(t.output)
        for e in result.exits:
            run.exits[e.row_id] = e
            run.left_step[e.row_id] = step
        for s in result.snapshots:
            run.snapshots[s.row_id] = s
        step += 1
        for row_id in list(batch.row_ids):
            plan = by_id[row_id]
            if plan.cancel_after is not None and len(run.outputs[row_id]) >= plan.cancel_after:
                run.exits[row_id] = batch.cancel(row_id)
                run.left_step[row_id] = step
    return run


def first_divergence(
    model: Any, prompt: Sequence[int], serial: Sequence[int], batched: Sequence[int]
) -> tuple[int, float] | None:
    """Index of the first differing greedy token and the serial logit gap between the two choices."""
    i = next((i for i, (a, b) in enumerate(zip(serial, batched, strict=False)) if a != b), None)
    if i is None:
        assert len(serial) == len(batched), "same tokens but different lengths"
        return None
    logits = model(mx.array([*prompt, *serial[:i]])[None])[0, -1]
    return i, float((logits[serial[i]] - logits[batched[i]]).item())


def assert_greedy_parity(
    model: Any, prompt: Sequence[int], serial: Sequence[int], batched: Sequence[int]
) -> None:
    """Equal tokens, or a first divergence at a near-tie of the serial logits."""
    found = first_divergence(model, prompt, serial, batched)
    if found is not None:
        i, gap = found
        assert abs(gap) < NEAR_TIE, (
            f"diverged at token {i} with a logit gap of {gap:.3g} (not a near-tie)"
        )


def assert_same_rows(got: Run, want: Run, rows: int, *, rounding: float) -> None:
    """Rows ``"0"`` to ``rows - 1`` in both runs, each with the same tokens, finish reasons and answer length, logprobs within ``rounding``."""
    assert set(got.outputs) == set(want.outputs) == {str(i) for i in range(rows)}
    for row_id, outputs in got.outputs.items():
        other = want.outputs[row_id]
        assert [o.token_id for o in outputs] == [o.token_id for o in other], row_id
        assert [o.finish_reason for o in outputs] == [o.finish_reason for o in other], row_id
        mine, theirs = [o.logprob for o in outputs], [o.logprob for o in other]
        assert (mine == theirs) if None in mine else mine == pytest.approx(theirs, abs=rounding), row_id
        assert got.exits[row_id].completion_tokens == want.exits[row_id].completion_tokens, row_id


def left_with(batch: BatchGeneration, prompt: Sequence[int], ids: Sequence[int]) -> tuple[int, ...]:
    """The tokens a plain row's exit cache holds: its prompt and answer, under read first not the answer's last token (its forward is not waited for)."""
    return (*prompt, *(ids[:-1] if batch.read_first else ids))


def _cache_holds(cache: list[Any], tokens: Sequence[int]) -> None:
    for layer in cache:
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int):
            assert offset == len(tokens)


# --- greedy parity ------------------------------------------------------------


def test_rows_joining_and_leaving_at_different_steps_match_serial_greedy(
    model: Any, tok: Any
) -> None:
    """10 prompts of distinct lengths, staggered joins, different max_tokens: each row's greedy tokens equal its serial run."""
    prompts = _prompts(len(tok), 10)
    rng = random.Random(1)
    plans = [
        Plan(str(i), p, SamplingParams(max_tokens=rng.randint(4, 30)), join_at=rng.randint(0, 25))
        for i, p in enumerate(prompts)
    ]
    batch = BatchGeneration(model, tok, max_rows=6, prefill_step_size=16)
    run = drive(batch, plans)
    assert len({run.left_step[p.row_id] for p in plans}) >= 5, "rows must leave at different steps"
    assert len({run.joined_step[p.row_id] for p in plans}) >= 5, "rows must join at different steps"
    assert max(d for d, _, _ in run.steps) >= 4, "several rows must decode together"
    exact = 0
    for p in plans:
        serial = [o.token_id for o in _serial(model, tok, p.prompt, p.params)]
        assert len(set(serial)) > 1 or len(serial) < 3, "the test model should vary its output"
        assert_greedy_parity(model, p.prompt, serial, run.ids(p.row_id))
        exact += serial == run.ids(p.row_id)
        e = run.exits[p.row_id]
        assert e.reason == "length"
        assert e.completion_tokens == p.params.max_tokens
        assert e.cache_tokens == left_with(batch, p.prompt, run.ids(p.row_id))
        _cache_holds(e.cache, e.cache_tokens)
    # NOTE: measured on this CPU: all 10 rows token-for-token equal (fp32).
    assert exact == len(plans)


@pytest.mark.parametrize(
    "build", [tiny_gemma3, tiny_mamba], ids=["gemma3-rotating", "mamba-recurrent"]
)
def test_rotating_and_recurrent_rows_match_serial_greedy(build: Any, tok: Any) -> None:
    """Sliding-window rings (prompts past the window) and recurrent state batch with serial greedy parity."""
    m = _lively(build, len(tok))
    prompts = _prompts(len(tok), 8, seed=2, lo=3, hi=40)
    plans = [
        Plan(str(i), p, SamplingParams(max_tokens=8 + 3 * i), join_at=2 * i)
        for i, p in enumerate(prompts)
    ]
    run = drive(BatchGeneration(m, tok, max_rows=8, prefill_step_size=16), plans)
    for p in plans:
        serial = [o.token_id for o in _serial(m, tok, p.prompt, p.params)]
        assert run.ids(p.row_id) == serial, f"row {p.row_id}"


def test_padded_batched_prefill_would_corrupt_recurrent_state(tok: Any) -> None:
    """Why rows prefill alone: mlx-lm's padded prefill feeds pad tokens into Mamba's state; ours does not."""
    from mlx_lm.generate import BatchGenerator

    m = _lively(tiny_mamba, len(tok))
    prompts = _prompts(len(tok), 6, seed=3, lo=3, hi=40)
    serial = [
        [o.token_id for o in _serial(m, tok, p, SamplingParams(max_tokens=12))] for p in prompts
    ]
    padded = BatchGenerator(m, max_tokens=12, prefill_batch_size=6, completion_batch_size=6)
    uids = padded.insert(prompts)
    out: dict[int, list[int]] = {u: [] for u in uids}
    for _ in range(40):
        for r in padded.next_generated():
            out[r.uid].append(r.token)
    assert any(out[u] != s for u, s in zip(uids, serial, strict=True)), (
        "precondition: padding corrupts the state"
    )
    run = drive(
        BatchGeneration(m, tok, max_rows=6),
        [Plan(str(i), p, SamplingParams(max_tokens=12)) for i, p in enumerate(prompts)],
    )
    assert [run.ids(str(i)) for i in range(len(prompts))] == serial


# --- cache reuse, extraction, snapshots ---------------------------------------


def test_row_with_cached_prefix_equals_cold_row_and_prefills_only_its_suffix(
    model: Any, tok: Any
) -> None:
    """Rows joining with a lent prefix (from a serial cache, and from another row's exit cache) give the cold row's tokens."""
    prompts = _prompts(len(tok), 3, seed=4, lo=30, hi=50)
    params = SamplingParams(max_tokens=12)
    first = drive(BatchGeneration(model, tok), [Plan("a", prompts[0], params)])
    donor = first.exits["a"]
    # A follow-up turn: the previous exchange plus a new user message.
    follow = [*donor.cache_tokens, *prompts[1][:9]]
    serial_gen = Generation(model, tok, prompts[2], params)
    while not serial_gen.prefill_step():
        pass
    lent_from_serial = clone_caches(serial_gen.cache, 25)
    lent_from_row = clone_caches(donor.cache, len(donor.cache_tokens))
    before = [mx.array(a) for layer in donor.cache for a in (layer.keys, layer.values)]
    batch = BatchGeneration(model, tok, max_rows=4, prefill_step_size=2048)
    run = drive(
        batch,
        [
            Plan("cold-follow", follow, params),
            Plan(
                "warm-follow",
                follow,
                params,
                cache=lent_from_row,
                cached_tokens=len(donor.cache_tokens),
            ),
            Plan("cold-2", prompts[2], params),
            Plan("warm-2", prompts[2], params, cache=lent_from_serial, cached_tokens=25),
        ],
    )
    assert (
        run.ids("warm-follow")
        == run.ids("cold-follow")
        == [o.token_id for o in _serial(model, tok, follow, params)]
    )
    assert run.ids("warm-2") == run.ids("cold-2")
    assert run.exits["warm-follow"].cached_tokens == len(donor.cache_tokens)
    assert run.exits["warm-2"].cache_tokens == left_with(batch, prompts[2], run.ids("warm-2"))
    # Prefill work: all four rows joined in one step; the warm rows forwarded only their suffix.
    prefilled = sum(p for _, _, p in run.steps)
    assert prefilled == (len(follow) - 1) + 8 + (len(prompts[2]) - 1) + (len(prompts[2]) - 1 - 25)
    after = [a for layer in donor.cache for a in (layer.keys, layer.values)]
    assert all(mx.array_equal(x, y).item() for x, y in zip(before, after, strict=True)), (
        "a lent cache was written"
    )


def test_exit_cache_serves_the_serial_lane(model: Any, tok: Any) -> None:
    """A finished row's extracted cache, reused by the serial lane, continues exactly like a cold prefill."""
    prompt = _prompts(len(tok), 1, seed=5, lo=20, hi=30)[0]
    run = drive(
        BatchGeneration(model, tok),
        [
            Plan("r", prompt, SamplingParams(max_tokens=10)),
            Plan("s", prompt[:7], SamplingParams(max_tokens=30)),
        ],
    )
    e = run.exits["r"]
    assert all(type(layer) is KVCache for layer in e.cache)
    nxt = [*e.cache_tokens, 5, 6, 7]
    cold = [o.token_id for o in _serial(model, tok, nxt, SamplingParams(max_tokens=8))]
    warm = _serial(
        model,
        tok,
        nxt,
        SamplingParams(max_tokens=8),
        cache=e.cache,
        cached_tokens=len(e.cache_tokens),
    )
    assert [o.token_id for o in warm] == cold


def test_prompt_boundary_snapshot_at_the_named_offset(model: Any, tok: Any) -> None:
    """Snapshots at prompt[:-1] and mid-prompt hold exactly those tokens (a serial prefill's KV) and serve a later row."""
    prompt = _prompts(len(tok), 1, seed=6, lo=40, hi=45)[0]
    params = SamplingParams(max_tokens=6)
    run = drive(
        BatchGeneration(model, tok, prefill_step_size=16),
        [
            Plan("snap", prompt, params, snapshot_at=len(prompt) - 1),
            Plan("mid", prompt[:30], params, snapshot_at=20),
        ],
    )
    snap = run.snapshots["snap"]
    assert snap.cache_tokens == tuple(prompt[:-1])
    _cache_holds(snap.cache, snap.cache_tokens)
    gen = Generation(model, tok, prompt, params)
    while not gen.prefill_step():
        pass
    for ours, theirs in zip(snap.cache, gen.cache, strict=True):
        k = theirs.keys[..., : theirs.offset, :]
        assert mx.allclose(ours.keys, k, atol=1e-5).item()
    mid = run.snapshots["mid"]
    assert mid.cache_tokens == tuple(prompt[:20])
    _cache_holds(mid.cache, mid.cache_tokens)
    assert run.ids("mid") == [o.token_id for o in _serial(model, tok, prompt[:30], params)]
    reuse = drive(
        BatchGeneration(model, tok),
        [
            Plan(
                "w",
                prompt,
                params,
                cache=snap.cache,
                cached_tokens=len(prompt) - 1,
                snapshot_at=len(prompt) - 1,
            )
        ],
    )
    assert reuse.ids("w") == run.ids("snap")
    assert reuse.snapshots == {}, (
        "a row whose whole prompt but one token was cached adds no snapshot"
    )


def test_a_snapshot_point_on_plain_kv_is_cut_from_one_forward(model: Any, tok: Any) -> None:
    """A snapshot point inside a plain-KV row's suffix does not end its prefill chunk: one forward,
    the snapshot cut back to the point (a serial prefill's KV there), tokens equal serial."""
    prompt = _prompts(len(tok), 1, seed=21, lo=30, hi=30)[0]
    params = SamplingParams(max_tokens=6)
    spy = ForwardSpy(model)
    run = drive(
        BatchGeneration(spy, tok, prefill_step_size=2048),
        [Plan("r", prompt, params, snapshot_at=12)],
    )
    assert spy.shapes[0] == (1, len(prompt) - 1), f"one prefill forward: {spy.shapes[:3]}"
    snap = run.snapshots["r"]
    assert snap.cache_tokens == tuple(prompt[:12])
    gen = Generation(model, tok, prompt[:13], params)
    while not gen.prefill_step():
        pass
    for ours, theirs in zip(snap.cache, gen.cache, strict=True):
        assert ours.offset == theirs.offset == 12
        assert mx.allclose(ours.keys[..., :12, :], theirs.keys[..., :12, :], atol=1e-5).item()
        assert mx.allclose(ours.values[..., :12, :], theirs.values[..., :12, :], atol=1e-5).item()
    assert run.ids("r") == [o.token_id for o in _serial(model, tok, prompt, params)]


@pytest.mark.parametrize(
    "build", [tiny_gemma3, tiny_mamba], ids=["gemma3-rotating", "mamba-recurrent"]
)
def test_a_snapshot_point_ends_the_chunk_where_caches_cannot_be_cut(build: Any, tok: Any) -> None:
    """Rotating rings and recurrent state keep the chunk that ends exactly at the snapshot point."""
    m = _lively(build, len(tok))
    prompt = _prompts(len(tok), 1, seed=21, lo=30, hi=30)[0]
    spy = ForwardSpy(m)
    run = drive(
        BatchGeneration(spy, tok, prefill_step_size=2048),
        [Plan("r", prompt, SamplingParams(max_tokens=4), snapshot_at=12)],
    )
    assert spy.shapes[:2] == [(1, 12), (1, len(prompt) - 1 - 12)], spy.shapes[:3]
    assert run.snapshots["r"].cache_tokens == tuple(prompt[:12])


# --- per-row sampling and stops -------------------------------------------------


def test_per_row_sampling_parameters_match_each_rows_serial_run(model: Any, tok: Any) -> None:
    """Seeded temperature/top-p/top-k/min-p/XTC rows, penalties and logit bias, side by side in one batch."""
    prompts = _prompts(len(tok), 8, seed=7, lo=10, hi=40)
    variants: list[dict[str, Any]] = [
        {"temperature": 1.0, "seed": 11},
        {"temperature": 0.8, "top_p": 0.9, "seed": 12},
        {"temperature": 0.7, "top_k": 5, "min_p": 0.05, "seed": 13},
        {"temperature": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.05, "seed": 14},
        {"repetition_penalty": 1.8, "repetition_context_size": 64},
        {"presence_penalty": 1.5, "frequency_penalty": 0.7},
        {"logit_bias": {3: 8.0, 17: -100.0}},
        {"logprobs": True},
    ]
    plans = [
        Plan(str(i), p, SamplingParams(max_tokens=14, **v), join_at=i)
        for i, (p, v) in enumerate(zip(prompts, variants, strict=True))
    ]
    run = drive(BatchGeneration(model, tok, max_rows=8, prefill_step_size=16), plans)
    for p in plans:
        serial = _serial(model, tok, p.prompt, p.params)
        assert run.ids(p.row_id) == [o.token_id for o in serial], f"row {p.row_id}: {p.params}"
    assert run.ids("0") != run.ids("1")
    for ours, theirs in zip(
        run.outputs["7"], _serial(model, tok, plans[7].prompt, plans[7].params), strict=True
    ):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    assert all(o.logprob is None for o in run.outputs["0"])


def test_top_logprobs_rows_report_the_serial_runs_alternatives(model: Any, tok: Any) -> None:
    """Rows asking for top_logprobs (greedy and seeded sampling, beside a plain row) report, for
    every token, the serial run's alternatives: the same ids in the same order, values within
    1e-4, the chosen token first at temperature 0; the plain row reports none."""
    prompts = _prompts(len(tok), 3, seed=5, lo=10, hi=40)
    variants: list[dict[str, Any]] = [
        {"logprobs": True, "top_logprobs": 4},
        {"temperature": 0.9, "seed": 21, "logprobs": True, "top_logprobs": 3},
        {},
    ]
    plans = [
        Plan(str(i), p, SamplingParams(max_tokens=12, **v), join_at=i)
        for i, (p, v) in enumerate(zip(prompts, variants, strict=True))
    ]
    run = drive(BatchGeneration(model, tok, max_rows=4, prefill_step_size=16), plans)
    for p in plans[:2]:
        serial = _serial(model, tok, p.prompt, p.params)
        assert run.ids(p.row_id) == [o.token_id for o in serial]
        for ours, theirs in zip(run.outputs[p.row_id], serial, strict=True):
            assert len(ours.top_logprobs) == p.params.top_logprobs
            assert [i for i, _ in ours.top_logprobs] == [i for i, _ in theirs.top_logprobs]
            for (_, mine), (_, ref) in zip(ours.top_logprobs, theirs.top_logprobs, strict=True):
                assert mine == pytest.approx(ref, abs=1e-4)
    assert all(o.top_logprobs[0][0] == o.token_id for o in run.outputs["0"])
    assert all(o.top_logprobs == () for o in run.outputs["2"])


def test_stop_strings_stop_ids_and_length_end_each_row_like_serial(model: Any, tok: Any) -> None:
    """Per-row stop strings, stop token ids and max_tokens: same text, token count and finish reason as serial."""
    prompt = _prompts(len(tok), 1, seed=8, lo=20, hi=30)[0]
    free = _serial(model, tok, prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=5))
    full = "".join(o.text for o in free)
    start = len("".join(o.text for o in free[:5])) + 1
    stop = full[start : start + 3]
    stop_id = free[8].token_id
    variants = {
        "stop-string": SamplingParams(max_tokens=24, temperature=1.0, seed=5, stop=(stop,)),
        "stop-id": SamplingParams(
            max_tokens=24, temperature=1.0, seed=5, stop_token_ids=(stop_id,)
        ),
        "length": SamplingParams(max_tokens=4, temperature=1.0, seed=5),
        "free": SamplingParams(max_tokens=24, temperature=1.0, seed=5),
    }
    run = drive(BatchGeneration(model, tok), [Plan(k, prompt, v) for k, v in variants.items()])
    for key, params in variants.items():
        serial = _serial(model, tok, prompt, params)
        ours = run.outputs[key]
        assert [o.token_id for o in ours] == [o.token_id for o in serial], key
        assert [o.text for o in ours] == [o.text for o in serial], key
        assert ours[-1].finish_reason == serial[-1].finish_reason == run.exits[key].reason, key
        assert all(o.finish_reason is None for o in ours[:-1])
        _cache_holds(run.exits[key].cache, run.exits[key].cache_tokens)
    assert run.exits["stop-string"].reason == "stop"
    assert stop not in run.text("stop-string")
    assert run.exits["length"].reason == "length"
    assert len({run.left_step[k] for k in variants}) >= 3


def test_eos_ends_a_row_with_stop(model: Any) -> None:
    """The tokenizer's EOS ends a row with 'stop' and releases no EOS text, as on the serial lane."""
    free_tok = tiny_tokenizer()
    free_tok.eos_token_ids = []
    prompt = _prompts(len(free_tok), 1, seed=9, lo=20, hi=30)[0]
    ids = [o.token_id for o in _serial(model, free_tok, prompt, SamplingParams(max_tokens=12))]
    eos_tok = tiny_tokenizer()
    eos_tok.eos_token_ids = [ids[4]]
    run = drive(
        BatchGeneration(model, eos_tok),
        [
            Plan("e", prompt, SamplingParams(max_tokens=12)),
            Plan("f", prompt[:5], SamplingParams(max_tokens=12)),
        ],
    )
    serial = _serial(model, eos_tok, prompt, SamplingParams(max_tokens=12))
    assert run.ids("e") == [o.token_id for o in serial] == ids[: ids.index(ids[4]) + 1]
    assert run.text("e") == "".join(o.text for o in serial)
    assert run.exits["e"].reason == "stop"


# --- cancel, budget, admission ----------------------------------------------


def test_cancel_removes_a_row_at_once_and_returns_its_cache(model: Any, tok: Any) -> None:
    """A cancelled decoding row leaves before the next step with its cache; the others keep serial parity."""
    prompts = _prompts(len(tok), 4, seed=10, lo=10, hi=40)
    params = SamplingParams(max_tokens=16)
    plans = [Plan(str(i), p, params) for i, p in enumerate(prompts)]
    plans[1].cancel_after = 5
    batch = BatchGeneration(model, tok, max_rows=4)
    run = drive(batch, plans)
    e = run.exits["1"]
    assert e.reason == "cancelled"
    assert e.completion_tokens == 5 == len(run.outputs["1"])
    assert e.cache_tokens == left_with(batch, prompts[1], run.ids("1"))
    _cache_holds(e.cache, e.cache_tokens)
    for p in plans:
        serial = [o.token_id for o in _serial(model, tok, p.prompt, params)]
        assert run.ids(p.row_id) == serial[: len(run.ids(p.row_id))]
        if p.row_id != "1":
            assert run.ids(p.row_id) == serial


def test_cancel_while_pending_or_mid_prefill(model: Any, tok: Any) -> None:
    """Cancelling a row before it started hands back its lent cache; mid-prefill, the part forwarded so far."""
    # NOTE: with no row decoding a turn forwards IDLE_PREFILL_ROWS chunks, so
    # the prompt is longer than that to be cancelled mid-prefill.
    budget = 8 * IDLE_PREFILL_ROWS
    prompt = _prompts(len(tok), 1, seed=11, lo=budget + 20, hi=budget + 25)[0]
    lent = make_prompt_cache(model)
    model(mx.array(prompt[:5])[None], cache=lent)
    batch = BatchGeneration(model, tok, prefill_step_size=8)
    batch.join("a", prompt, SamplingParams(), cache=lent, cached_tokens=5)
    batch.join("b", prompt, SamplingParams())
    result = batch.step()
    assert result.prefill_tokens == budget
    assert batch.pending == ("a", "b")
    mid = batch.cancel("a")
    assert mid.cache_tokens == tuple(prompt[: 5 + budget])
    assert mid.reason == "cancelled"
    _cache_holds(mid.cache, mid.cache_tokens)
    untouched = batch.cancel("b")
    assert untouched.cache == []
    assert untouched.cache_tokens == ()
    assert batch.idle
    with pytest.raises(UnknownRow):
        batch.cancel("a")


@pytest.mark.parametrize("read_first", [False, True])
def test_one_step_forwards_at_most_one_chunk_of_prompt_and_one_token_per_decoding_row(
    model: Any, tok: Any, read_first: bool
) -> None:
    """Joining rows share a per-step prefill budget while decoding rows each get exactly one token per step.

    A row entering the decode batch is forwarded by that step's decode (its
    last prompt token) and is not a decoding row yet: in mlx-lm's order it
    emits nothing there, read first it emits its first token there.
    """
    prompts = _prompts(len(tok), 4, seed=12, lo=25, hi=40)
    plans = [Plan("early", prompts[0][:6], SamplingParams(max_tokens=40))] + [
        Plan(str(i), p, SamplingParams(max_tokens=3), join_at=3) for i, p in enumerate(prompts[1:])
    ]
    run = drive(BatchGeneration(model, tok, prefill_step_size=8, read_first=read_first), plans)
    assert all(prefill <= 8 for _, _, prefill in run.steps)
    assert sum(run.entered) == len(plans)
    firsts = run.entered if read_first else [0] * len(run.entered)
    assert all(out == rows + first for (rows, out, _), first in zip(run.steps, firsts, strict=True))
    # While the late rows prefill (steps 3..), the early row still gets a token every step.
    early_steps = [i for i, (rows, _, prefill) in enumerate(run.steps) if prefill > 0 and i >= 3]
    assert len(early_steps) >= 9
    assert all(run.steps[i][0] >= 1 for i in early_steps)


def test_admission_errors(model: Any, tok: Any) -> None:
    """A full batch, a duplicate row id, an empty or fully cached prompt, a mismatched or quantized cache are refused."""
    batch = BatchGeneration(model, tok, max_rows=2)
    batch.join("a", [1, 2, 3], SamplingParams())
    with pytest.raises(InvalidPrompt):
        batch.join("a", [1, 2, 3], SamplingParams())
    batch.join("b", [1, 2, 3], SamplingParams())
    with pytest.raises(BatchFull):
        batch.join("c", [1, 2, 3], SamplingParams())
    small = BatchGeneration(model, tok)
    with pytest.raises(InvalidPrompt):
        small.join("x", [], SamplingParams())
    cache = make_prompt_cache(model)
    model(mx.array([1, 2, 3])[None], cache=cache)
    with pytest.raises(InvalidPrompt):
        small.join("x", [1, 2, 3], SamplingParams(), cache=cache, cached_tokens=3)
    with pytest.raises(InvalidPrompt):
        small.join("x", [1, 2, 3, 4], SamplingParams(), cache=cache, cached_tokens=2)
    quant = [QuantizedKVCache(), QuantizedKVCache()]
    with pytest.raises(InvalidPrompt, match="quantized"):
        small.join("x", [1, 2, 3, 4], SamplingParams(), cache=quant, cached_tokens=3)
    assert batch_params_refusal(SamplingParams(grammar="start: 'a'")) is None
    assert batch_params_refusal(SamplingParams(prompt_logprobs=1)) == "prompt_logprobs"
    assert batch_params_refusal(SamplingParams(logprobs=True, top_logprobs=2)) is None
    assert batch_params_refusal(SamplingParams(logprobs=True)) is None
    with pytest.raises(InvalidPrompt, match="snapshot_at"):
        small.join("x", [1, 2, 3], SamplingParams(), snapshot_at=3)
    assert small.idle


# --- gates --------------------------------------------------------------------


def test_gate_layer_kinds_of_model_families(tok: Any) -> None:
    """Full attention, sliding-window and recurrent models are batchable with their per-layer kinds."""
    assert model_batch_gate(lively_llama(len(tok))).kinds == ("full", "full")
    g = model_batch_gate(tiny_gemma3(vocab_size=len(tok)))
    assert g.batchable
    assert g.kinds == ("rotating", "rotating", "full")
    m = model_batch_gate(tiny_mamba(vocab_size=len(tok)), batch_ssm=True)
    assert m.batchable
    assert m.recurrent
    assert m.kinds == ("recurrent", "recurrent")


def test_gate_refusals_name_their_reason(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unknown kinds, quantized layers the scheme does not produce, kept ring tokens and recurrent state with KVTIER_BATCH_SSM=0 are refused."""
    monkeypatch.setenv("KVTIER_BATCH_SSM", "0")
    assert not batch_ssm_enabled()
    mamba = model_batch_gate(tiny_mamba(vocab_size=len(tok)))
    assert mamba.refusal == "recurrent_disabled"
    monkeypatch.setenv("KVTIER_BATCH_SSM", "1")
    assert model_batch_gate(tiny_mamba(vocab_size=len(tok))).batchable
    assert batch_gate([KVCache(), ChunkedKVCache(8)]).refusal == "unknown_cache_kind"

    class MyKV(KVCache):  # type: ignore[misc]
        pass

    assert batch_gate([MyKV()]).refusal == "unknown_cache_kind", (
        "an undeclared subclass must not route"
    )
    assert batch_gate([QuantizedKVCache()]).refusal == "quantized_cache"
    assert batch_gate([RotatingKVCache(max_size=8, keep=4)]).refusal == "rotating_keep"
    assert batch_gate([CacheList(KVCache(), ArraysCache(2))], batch_ssm=True).kinds == ("list",)
    assert (
        batch_gate([CacheList(KVCache(), ArraysCache(2))], batch_ssm=False).refusal
        == "recurrent_disabled"
    )
    assert batch_gate([CacheList(KVCache(), QuantizedKVCache())]).refusal == "quantized_cache"
    q8 = KvScheme(kind="affine-uniform", uniform=LayerQuant(bits=8))
    refused = batch_gate([KVCache(), QuantizedKVCache(bits=4)], q8)
    assert refused.refusal == "quantized_cache"
    assert "4-bit" in refused.detail
    assert batch_gate([KVCache()], KvScheme()).batchable


# --- the real default model ----------------------------------------------------


@pytest.mark.model
def test_default_model_rows_match_serial_greedy(default_model_path: Path) -> None:
    """6 chat prompts on the default fp32 model, staggered: every row's greedy tokens equal its serial run.

    NOTE: six rows of the eight `tools/bench/batching.py --parity` compares
    (16 of 16 recorded): enough for joins and leaves while others decode,
    within the default suite's budget.
    """
    lm = load_model(default_model_path)
    questions = [
        "Hi",
        "What is 2 + 2?",
        "Name three colours of the rainbow.",
        "Write one short sentence about the sea and the wind.",
        "What does a CPU do? Answer in two short sentences, for a curious child of eight.",
        "List the first five prime numbers and explain briefly why each of them is prime; then say which is the only even one and why that matters.",
    ]
    prompts = [render_chat(lm.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    assert len({len(p) for p in prompts}) == len(prompts)
    plans = [
        Plan(str(i), p, SamplingParams(max_tokens=6 + i), join_at=i) for i, p in enumerate(prompts)
    ]
    run = drive(BatchGeneration(lm.model, lm.tokenizer, max_rows=8, prefill_step_size=64), plans)
    for p in plans:
        serial = [o.token_id for o in _serial(lm.model, lm.tokenizer, p.prompt, p.params, step=64)]
        assert_greedy_parity(lm.model, p.prompt, serial, run.ids(p.row_id))


class ForwardSpy:
    """Delegates to a model and records the (batch, tokens) shape of every forward."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.shapes: list[tuple[int, int]] = []

    def __call__(self, inputs: mx.array, **kw: Any) -> Any:
        self.shapes.append((int(inputs.shape[0]), int(inputs.shape[1])))
        return self._model(inputs, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_rows_starting_together_prefill_as_one_padded_group(model: Any, tok: Any) -> None:
    """Rows that start in one step share padded prefill forwards; snapshots and tokens still equal serial."""
    prompts = _prompts(len(tok), 3, seed=13, lo=20, hi=40)
    points = [10, len(prompts[1]) - 1, None]
    params = SamplingParams(max_tokens=10)
    plans = [
        Plan(str(i), p, params, snapshot_at=pt)
        for i, (p, pt) in enumerate(zip(prompts, points, strict=True))
    ]
    spy = ForwardSpy(model)
    run = drive(BatchGeneration(spy, tok, prefill_step_size=2048), plans)
    assert run.steps[0][2] == sum(len(p) - 1 for p in prompts), (
        "all three prefilled in the first step"
    )
    assert spy.shapes[0][0] == 3, (
        f"the first forward is the group's padded prefill: {spy.shapes[:3]}"
    )
    for i, p in enumerate(prompts):
        assert run.ids(str(i)) == [o.token_id for o in _serial(model, tok, p, params)]
    for i in (0, 1):
        snap = run.snapshots[str(i)]
        point = points[i]
        assert point is not None
        assert snap.cache_tokens == tuple(prompts[i][:point])
        gen = Generation(model, tok, prompts[i][: point + 1], params)
        while not gen.prefill_step():
            pass
        for ours, theirs in zip(snap.cache, gen.cache, strict=True):
            assert ours.offset == theirs.offset == point
            assert mx.allclose(
                ours.keys[..., : ours.offset, :], theirs.keys[..., : theirs.offset, :], atol=1e-5
            ).item()
    assert "2" not in run.snapshots


class PaddingSpy:
    """Records the right padding every ``BatchKVCache.prepare`` is given (what ``finalize`` then rolls)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from mlx_lm.models.cache import BatchKVCache

        self.right: list[list[int]] = []
        inner = BatchKVCache.prepare

        def prepare(cache: Any, **kw: Any) -> Any:
            if kw.get("right_padding") is not None:
                self.right.append(list(kw["right_padding"]))
            return inner(cache, **kw)

        monkeypatch.setattr(BatchKVCache, "prepare", prepare)

    @property
    def padded(self) -> bool:
        return any(max(pads) > 0 for pads in self.right)


def _shared_prefix_plans(
    model: Any, tok: Any, suffixes: Sequence[int], params: SamplingParams, *, cold: int = -1
) -> tuple[list[Plan], list[Any]]:
    """Rows over one lent 30-token prefix with suffixes of these lengths (row ``cold`` without the cache)."""
    rng = random.Random(21)
    prefix = [rng.randrange(0, len(tok) - 2) for _ in range(30)]
    gen = Generation(model, tok, [*prefix, 1], params)
    while not gen.prefill_step():
        pass
    plans: list[Plan] = []
    lent: list[Any] = []
    for i, n in enumerate(suffixes):
        prompt = [*prefix, *(rng.randrange(0, len(tok) - 2) for _ in range(n))]
        if i == cold:
            plans.append(Plan(f"r{i}", prompt, params))
            continue
        cache = clone_caches(gen.cache, len(prefix))
        lent.append(cache)
        plans.append(Plan(f"r{i}", prompt, params, cache=cache, cached_tokens=len(prefix)))
    return plans, lent


def test_suffixes_of_different_lengths_are_aligned_not_padded(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows over one lent prefix with suffixes of 5, 9 and 14 tokens prefill in one unpadded
    forward of 14 tokens each (the shorter re-forward their prefix's last tokens), give the
    serial lane's tokens, and leave the lent caches as they were."""
    params = SamplingParams(max_tokens=10)
    plans, lent = _shared_prefix_plans(model, tok, [5, 9, 14], params)
    offsets = [[layer.offset for layer in cache] for cache in lent]
    pads = PaddingSpy(monkeypatch)
    spy = ForwardSpy(model)
    batch = BatchGeneration(spy, tok, prefill_step_size=2048)
    run = drive(batch, plans)
    assert spy.shapes[0] == (3, 13), f"one aligned forward of the longest suffix: {spy.shapes[:3]}"
    assert not pads.padded, f"a padded (rolled) prefill: {pads.right}"
    assert run.steps[0][2] == 3 * 13
    for p in plans:
        assert_greedy_parity(
            model, p.prompt, [o.token_id for o in _serial(model, tok, p.prompt, params)],
            run.ids(p.row_id),
        )
        assert run.exits[p.row_id].cache_tokens == left_with(batch, p.prompt, run.ids(p.row_id))
        assert run.exits[p.row_id].cached_tokens == len(p.prompt) - 14, "the prefix given back"
    assert [[layer.offset for layer in cache] for cache in lent] == offsets


def test_a_cold_row_shorter_than_the_others_keeps_the_padded_group(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row with nothing cached cannot give tokens back: the group pads as before (and still
    gives the serial lane's tokens)."""
    params = SamplingParams(max_tokens=8)
    plans, _ = _shared_prefix_plans(model, tok, [40, 12], params, cold=1)
    plans[1] = Plan("r1", plans[1].prompt[25:], params)  # NOTE: 17 tokens, cold.
    pads = PaddingSpy(monkeypatch)
    run = drive(BatchGeneration(model, tok, prefill_step_size=2048), plans)
    assert pads.padded
    for p in plans:
        assert_greedy_parity(
            model, p.prompt, [o.token_id for o in _serial(model, tok, p.prompt, params)],
            run.ids(p.row_id),
        )


def test_align_suffixes_off_pads_the_group(model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """align_suffixes=False (KVTIER_BATCH_ALIGN_SUFFIXES=0): the group pads its shorter suffixes and
    every row keeps its whole lent prefix."""
    params = SamplingParams(max_tokens=6)
    plans, _ = _shared_prefix_plans(model, tok, [5, 14], params)
    pads = PaddingSpy(monkeypatch)
    run = drive(BatchGeneration(model, tok, prefill_step_size=2048, align_suffixes=False), plans)
    assert pads.padded
    assert [run.exits[p.row_id].cached_tokens for p in plans] == [30, 30]


def test_prefill_keeps_the_buffer_cache_unless_told(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVTIER_BATCH_PREFILL_CLEAR unset or 0: the batch lane's prefill forwards leave MLX's buffer
    cache alone (mlx-lm, and the switch at 1, empty it after each); every row's tokens are the same."""
    params = SamplingParams(max_tokens=6)
    prompts = _prompts(len(tok), 3, seed=5, lo=20, hi=50)
    cleared: list[int] = []
    inner = mx.clear_cache

    def counted() -> None:
        cleared.append(1)
        inner()

    monkeypatch.setattr(mx, "clear_cache", counted)
    runs: dict[str, Run] = {}
    for switch in ("1", "0", ""):
        if switch:
            monkeypatch.setenv("KVTIER_BATCH_PREFILL_CLEAR", switch)
        else:
            monkeypatch.delenv("KVTIER_BATCH_PREFILL_CLEAR", raising=False)
        cleared.clear()
        plans = [Plan(str(i), p, params, join_at=i) for i, p in enumerate(prompts)]
        runs[switch] = drive(BatchGeneration(model, tok, prefill_step_size=16), plans)
        assert (len(cleared) > 0) == (switch == "1"), f"{len(cleared)} releases with the switch {switch}"
    for i in range(len(prompts)):
        assert runs["0"].ids(str(i)) == runs["1"].ids(str(i)) == runs[""].ids(str(i))
