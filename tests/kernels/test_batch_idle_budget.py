"""The batch kernel's prefill budget: one chunk per turn while rows decode, wider while none does."""

from __future__ import annotations

from typing import Any

import pytest

from kernels.engine import IDLE_PREFILL_ROWS, BatchGeneration, SamplingParams
from tests.kernels.test_batch import ForwardSpy, Plan, _prompts, _serial, drive

STEP = 16


def test_rows_arriving_together_prefill_in_one_turn_when_no_row_decodes(
    model: Any, tok: Any
) -> None:
    """With no row decoding, rows whose prompts need several chunks' budget prefill in the first turn, one forward per chunk, and still equal serial greedy."""
    prompts = _prompts(len(tok), 4, seed=21, lo=12, hi=16)
    total = sum(len(p) - 1 for p in prompts)
    assert STEP < total <= STEP * IDLE_PREFILL_ROWS, "the prompts must need more than one chunk"
    params = SamplingParams(max_tokens=6)
    spy = ForwardSpy(model)
    run = drive(
        BatchGeneration(spy, tok, prefill_step_size=STEP),
        [Plan(str(i), p, params) for i, p in enumerate(prompts)],
    )
    assert run.steps[0][2] == total, f"every row prefilled in the first turn: {run.steps[:3]}"
    assert spy.shapes[0][0] == len(prompts), f"one padded forward for the group: {spy.shapes[:3]}"
    for i, p in enumerate(prompts):
        assert run.ids(str(i)) == [o.token_id for o in _serial(model, tok, p, params, step=STEP)]


def test_budget_is_one_chunk_again_once_a_row_decodes(model: Any, tok: Any) -> None:
    """Rows joining while another row decodes share one chunk per turn, so the decoding row waits for at most one chunk."""
    prompts = _prompts(len(tok), 4, seed=22, lo=12, hi=16)
    params = SamplingParams(max_tokens=30)
    plans = [Plan("early", prompts[0][:5], params)] + [
        Plan(str(i), p, SamplingParams(max_tokens=3), join_at=2) for i, p in enumerate(prompts[1:])
    ]
    run = drive(BatchGeneration(model, tok, prefill_step_size=STEP), plans)
    late = [prefill for rows, _, prefill in run.steps[2:] if rows >= 1 and prefill > 0]
    assert sum(late) == sum(len(p) - 1 for p in prompts[1:])
    assert len(late) >= 2, late
    assert all(prefill <= STEP for prefill in late), late


def test_a_budget_below_the_chunk_lets_one_joining_chunk_ride_per_step(model: Any, tok: Any) -> None:
    """With prefill_budget under the chunk size, rows joining while another decodes start one per step, each in one whole chunk, and still equal serial greedy."""
    prompts = _prompts(len(tok), 4, seed=23, lo=10, hi=15)
    params = SamplingParams(max_tokens=3)
    plans = [Plan("early", prompts[0][:5], SamplingParams(max_tokens=30))] + [
        Plan(str(i), p, params, join_at=2) for i, p in enumerate(prompts[1:])
    ]
    # NOTE: a 32-token chunk holds two of these prompts; the budget of 4 lets one go a step.
    chunk = 2 * STEP
    spy = ForwardSpy(model)
    run = drive(BatchGeneration(spy, tok, prefill_step_size=chunk, prefill_budget=4), plans)
    late = [prefill for rows, _, prefill in run.steps[2:] if rows >= 1 and prefill > 0]
    assert sorted(late) == sorted(len(p) - 1 for p in prompts[1:]), f"one whole prompt a step: {late}"
    for i, p in enumerate(prompts[1:]):
        assert run.ids(str(i)) == [o.token_id for o in _serial(model, tok, p, params, step=chunk)]


def test_a_budget_below_one_token_is_refused(model: Any, tok: Any) -> None:
    """prefill_budget must be at least 1 token."""
    with pytest.raises(ValueError, match="prefill_budget"):
        BatchGeneration(model, tok, prefill_budget=0)
