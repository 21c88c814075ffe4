"""The batch lane's engine job (``BatchEngine.step``) on a tiny fp32 Llama: per-row restores and memory checks.

A cold-tier hit that cannot be restored joins cold with the right tokens; the
memory-pressure guard refuses one row before its prefill or during its decode
and that row alone leaves the batch, the others going on unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest

from actors.batch_scheduler import engine as batch_engine
from actors.batch_scheduler.core import JoinRow, RowFailure, StepOut
from actors.batch_scheduler.engine import BatchEngine
from actors.engine_thread.memory_guard import Footprint, MemoryGauge, MemoryGuard
from messages.gateway import Generate, GenerationParams

KV_PER_TOKEN = 1000
"""The scripted geometry: every token of KV costs this many bytes."""


def _gen(rid: str, prompt: list[int], max_tokens: int) -> Generate:
    return Generate(
        request_id=rid,
        prompt_tokens=tuple(prompt),
        params=GenerationParams(max_tokens=max_tokens),
        stream_to=f"inbox.{rid}",
    )


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 90 + 3 for i in range(n)]


def _engine(model: Any, tok: Any, **options: Any) -> BatchEngine:
    return BatchEngine(model, tok, max_rows=4, prefill_step_size=64, **options)


def _drive(engine: BatchEngine, joins: list[JoinRow]) -> tuple[dict[str, list[int]], list[StepOut]]:
    """Step until every row left; the tokens of each row and every step's output."""
    tokens: dict[str, list[int]] = {}
    outs: list[StepOut] = []
    live = {j.request.request_id for j in joins}
    first = True
    while live:
        out = engine.step(joins if first else [], [])
        first = False
        outs.append(out)
        for t in out.tokens:
            tokens.setdefault(t.request_id, []).append(t.token_id)
        live -= {e.request_id for e in out.exits}
        live -= {f.request_id for f in out.failed}
        assert len(outs) < 2000, "the batch never finished"
    engine.reset()
    return tokens, outs


class _Guard:
    """A scripted memory guard: a budget, a linear KV geometry and a gauge the test sets."""

    def __init__(self, budget: int) -> None:
        self.active = 0
        self.guard = MemoryGuard(
            budget=budget,
            footprint=Footprint(kv_bytes_at=lambda n: n * KV_PER_TOKEN, chunk=64),
            gauge=MemoryGauge(lambda: self.active),
        )


@pytest.mark.parametrize("failure", ["lost", "raises"])
def test_an_ssd_hit_that_cannot_be_restored_joins_cold_with_the_right_tokens(
    model: Any, tok: Any, failure: str
) -> None:
    """A row lent a cold-tier hit whose restore finds nothing (bytes pushed out, mismatch) or
    raises (materialization failed) joins cold: 0 tokens reused, counted as restore_failed, its
    whole prompt forwarded, and the greedy tokens of a row that had no hit."""
    calls: list[tuple[str, str, int]] = []

    def restore(request: Generate, staging_id: str, tokens: int) -> list[Any] | None:
        calls.append((request.request_id, staging_id, tokens))
        if failure == "raises":
            raise ValueError("materialize failed")
        return None

    prompt = _prompt(30, 1)
    cold, _ = _drive(_engine(model, tok), [JoinRow(_gen("r", prompt, 8))])
    engine = _engine(model, tok, restore=restore)
    join = JoinRow(_gen("r", prompt, 8), None, 20, "staged-1")
    got, outs = _drive(engine, [join])
    assert calls == [("r", "staged-1", 20)]
    assert (outs[0].joined, outs[0].restored, outs[0].restore_failed) == ((("r", 0),), (), ("r",))
    assert outs[0].prefill_tokens == len(prompt) - 1
    assert got == cold


def test_a_row_refused_before_its_prefill_leaves_alone_and_is_never_restored(
    model: Any, tok: Any
) -> None:
    """With the guard over budget for one row only, that row fails with MemoryShortAtStart (a
    MemoryPressure before its prefill) at its join (its SSD hit is not restored), the other row
    joins and gives its solo tokens."""
    small, big = _prompt(12, 2), _prompt(40, 3)
    solo, _ = _drive(_engine(model, tok), [JoinRow(_gen("a", small, 10))])
    # NOTE: at prefill a row needs KV(prompt + max_tokens) + KV(prompt), in 256-token steps:
    # "a" needs 256k + 256k, "b" (max_tokens 600) 768k + 256k; the budget admits only "a".
    scripted = _Guard(budget=800 * KV_PER_TOKEN)
    restored: list[str] = []

    def restore(request: Generate, staging_id: str, tokens: int) -> list[Any] | None:
        restored.append(staging_id)
        return None

    engine = _engine(model, tok, guard=scripted.guard, restore=restore)
    joins = [JoinRow(_gen("a", small, 10)), JoinRow(_gen("b", big, 600), None, 30, "staged-b")]
    got, outs = _drive(engine, joins)
    (failure,) = outs[0].failed
    assert (failure.request_id, failure.error_code) == ("b", "MemoryShortAtStart")
    assert "not enough memory" in failure.detail
    assert outs[0].joined == (("a", 0),)
    assert restored == []
    assert got == {"a": solo["a"]}
    assert scripted.guard.refused == 1


def test_rows_joining_in_one_step_are_checked_beside_each_other(model: Any, tok: Any) -> None:
    """Two rows that each fit the budget alone (512k of 800k) but not together join the same
    step: the reading shows neither (their prefill runs after the checks), so the second is
    checked beside the first's demand and refused before its prefill; the first runs alone."""
    a, b = _prompt(12, 6), _prompt(12, 7)
    solo, _ = _drive(_engine(model, tok), [JoinRow(_gen("a", a, 10))])
    scripted = _Guard(budget=800 * KV_PER_TOKEN)
    engine = _engine(model, tok, guard=scripted.guard)
    got, outs = _drive(engine, [JoinRow(_gen("a", a, 10)), JoinRow(_gen("b", b, 10))])
    (failure,) = outs[0].failed
    assert (failure.request_id, failure.error_code) == ("b", "MemoryShortAtStart")
    assert outs[0].joined == (("a", 0),)
    assert got == {"a": solo["a"]}
    assert (scripted.guard.checks, scripted.guard.refused) == (2, 1)


@pytest.mark.parametrize(("running_max_tokens", "joins"), [(600, False), (20, True)])
def test_a_join_is_checked_beside_what_the_running_rows_may_still_grow_by(
    model: Any, tok: Any, running_max_tokens: int, joins: bool
) -> None:
    """A row joining beside a decoding one is checked beside the KV that row may still add (to
    its max_tokens): with 600 tokens to come (512k more KV) the join that fits the reading
    (600k in use + 512k of 1,500k) is refused before its prefill; with 20 to come (no new KV
    buffer) it joins."""
    scripted = _Guard(budget=1500 * KV_PER_TOKEN)
    engine = _engine(model, tok, guard=scripted.guard)
    first = engine.step([JoinRow(_gen("a", _prompt(10, 8), running_max_tokens))], [])
    assert (first.joined, first.failed) == ((("a", 0),), ())
    scripted.active = 600 * KV_PER_TOKEN
    out = engine.step([JoinRow(_gen("b", _prompt(12, 9), 10))], [])
    if joins:
        assert (out.joined, out.failed) == ((("b", 0),), ())
    else:
        (failure,) = out.failed
        assert (failure.request_id, failure.error_code) == ("b", "MemoryShortAtStart")
        assert out.joined == ()
    assert any(t.request_id == "a" for t in out.tokens), "the running row went on"
    engine.reset()


def test_the_batch_lane_reports_its_rows_growth_and_checks_joins_beside_the_serial_lanes(
    model: Any, tok: Any
) -> None:
    """After a step the batch lane publishes its row's KV still to come (a row of 10 + 600
    tokens: 768k - 256k); a join that fits beside it alone is refused beside 600k more of the
    serial lane's published growth, and joins once that is gone; reset publishes 0."""
    scripted = _Guard(budget=2000 * KV_PER_TOKEN)
    engine = _engine(model, tok, guard=scripted.guard)
    engine.step([JoinRow(_gen("a", _prompt(10, 8), 600))], [])
    assert scripted.guard.ahead.snapshot() == {"batch": 512 * KV_PER_TOKEN}
    scripted.guard.ahead.publish("serial", 600 * KV_PER_TOKEN)
    scripted.active = 600 * KV_PER_TOKEN
    refused = engine.step([JoinRow(_gen("b", _prompt(12, 9), 10))], [])
    assert [f.request_id for f in refused.failed] == ["b"]
    scripted.guard.ahead.publish("serial", 0)
    joined = engine.step([JoinRow(_gen("b", _prompt(12, 9), 10))], [])
    assert (joined.joined, joined.failed) == ((("b", 0),), ())
    engine.reset()
    assert scripted.guard.ahead.snapshot()["batch"] == 0


def test_a_join_of_the_same_step_counts_once_beside_the_next(model: Any, tok: Any) -> None:
    """Two joins of one step that fit together (1,024k + 512k of 1,600k): the first's growth to its
    600 tokens is in its own demand, not counted again as a running row's for the second."""
    scripted = _Guard(budget=1600 * KV_PER_TOKEN)
    engine = _engine(model, tok, guard=scripted.guard)
    out = engine.step([JoinRow(_gen("a", _prompt(10, 8), 600)),
                       JoinRow(_gen("b", _prompt(12, 9), 10))], [])
    assert (out.joined, out.failed) == ((("a", 0), ("b", 0)), ())
    engine.reset()


def test_one_step_settles_memory_once_however_many_joins_it_refuses(model: Any, tok: Any) -> None:
    """Three joins of one step over the budget: each is refused before its prefill, but only the
    first refusal settles memory (clears MLX's cache, trims the heap) and reads again; the next
    two decide on their first reading."""
    scripted = _Guard(budget=100)
    settles: list[int] = []
    scripted.guard.settle = lambda: settles.append(1)
    engine = _engine(model, tok, guard=scripted.guard)
    joins = [JoinRow(_gen(rid, _prompt(12, i), 10)) for i, rid in enumerate("abc")]
    out = engine.step(joins, [])
    assert [f.request_id for f in out.failed] == ["a", "b", "c"]
    assert (scripted.guard.checks, scripted.guard.refused, len(settles)) == (3, 3, 1)
    assert scripted.guard.settled == 1


def test_a_row_refused_during_decode_leaves_alone_and_the_others_go_on(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every DECODE_CHECK_EVERY tokens of each row the guard is asked before the step; when
    memory grows so that only the row with the larger projected KV no longer fits, that row
    fails with MemoryPressure (no token lost: it produced exactly a multiple of the interval)
    and leaves the batch, while the other row finishes with its solo tokens."""
    monkeypatch.setattr(batch_engine, "DECODE_CHECK_EVERY", 4)
    a, b = _prompt(10, 4), _prompt(14, 5)
    solo, _ = _drive(_engine(model, tok), [JoinRow(_gen("a", a, 20))])
    scripted = _Guard(budget=2000 * KV_PER_TOKEN)
    engine = _engine(model, tok, guard=scripted.guard)
    joins = [JoinRow(_gen("a", a, 20)), JoinRow(_gen("b", b, 600))]
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    failures: list[RowFailure] = []
    out = engine.step(joins, [])
    # NOTE: from now on 1.5M bytes are in use: "a" (KV of 256 tokens) still fits the 2M
    # budget, "b" (KV of 768 tokens) does not.
    scripted.active = 1500 * KV_PER_TOKEN
    steps = 0
    while True:
        failures.extend(out.failed)
        for t in out.tokens:
            tokens[t.request_id].append(t.token_id)
        if any(e.request_id == "a" for e in out.exits):
            break
        out = engine.step([], [])
        steps += 1
        assert steps < 100
    (failure,) = failures
    assert (failure.request_id, failure.error_code) == ("b", "MemoryPressure")
    assert len(tokens["b"]) == 4
    assert tokens["a"] == solo["a"]
    assert scripted.guard.refused == 1
    assert engine.step([], []).tokens == ()


@pytest.mark.parametrize(("budget", "per_step"), [(None, 2), (4, 1)])
def test_the_prefill_budget_sets_how_many_joining_prompts_a_decoding_step_takes(
    model: Any, tok: Any, budget: int | None, per_step: int
) -> None:
    """Two rows joining while another decodes prefill in one step under the default budget (one 64-token chunk holds both) and one a step under prefill_budget=4; tokens are the same."""
    options: dict[str, Any] = {} if budget is None else {"prefill_budget": budget}
    engine = _engine(model, tok, **options)
    first = engine.step([JoinRow(_gen("a", _prompt(6, 1), 12))], [])
    assert first.prefill_tokens == 5
    # NOTE: the next step prefills nothing (nothing is pending; in mlx-lm's
    # order it also hands out a's first token), so the others join the step after it.
    assert engine.step([], []).prefill_tokens == 0
    out = engine.step([JoinRow(_gen("b", _prompt(20, 2), 4)), JoinRow(_gen("c", _prompt(24, 3), 4))], [])
    assert out.decode_rows == 1, "the second step decodes row a"
    assert out.prefill_tokens == (19 + 23 if per_step == 2 else 19)
    assert len(out.prefilled) == per_step
    engine.reset()
