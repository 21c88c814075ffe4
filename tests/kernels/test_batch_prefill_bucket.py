"""Prefill buckets: a warm row's (or group's) prefill forward rounded up by re-forwarding lent tokens, tokens unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from kernels import SamplingParams
from kernels.engine import (
    CUDA_PREFILL_BUCKET,
    PREFILL_BUCKET_ENV,
    BatchGeneration,
    prefill_bucket_setting,
)
from tests.kernels.test_batch import (
    ForwardSpy,
    PaddingSpy,
    Plan,
    _serial,
    _shared_prefix_plans,
    assert_greedy_parity,
    drive,
)


def _check_parity(model: Any, tok: Any, plans: list[Plan], run: Any, params: SamplingParams) -> None:
    for p in plans:
        assert_greedy_parity(
            model, p.prompt, [o.token_id for o in _serial(model, tok, p.prompt, params)], run.ids(p.row_id)
        )


def test_a_lone_warm_row_forwards_a_multiple_of_the_bucket(model: Any, tok: Any) -> None:
    """One row over a lent 30-token prefix with a 7-token suffix (6 to prefill): bucket 8 forwards 8, giving 2 cached tokens back; same tokens."""
    params = SamplingParams(max_tokens=8)
    plans, _ = _shared_prefix_plans(model, tok, [7], params)
    spy = ForwardSpy(model)
    run = drive(BatchGeneration(spy, tok, prefill_step_size=2048, prefill_bucket=8), plans)
    assert spy.shapes[0] == (1, 8), f"the prefill forward: {spy.shapes[:2]}"
    assert run.exits["r0"].cached_tokens == 30 - 2
    _check_parity(model, tok, plans, run, params)


def test_without_a_bucket_the_lone_row_forwards_its_suffix(model: Any, tok: Any) -> None:
    """prefill_bucket=0 (the default): the same row forwards its 6 tokens and keeps its whole lent prefix."""
    params = SamplingParams(max_tokens=8)
    plans, _ = _shared_prefix_plans(model, tok, [7], params)
    spy = ForwardSpy(model)
    run = drive(BatchGeneration(spy, tok, prefill_step_size=2048, prefill_bucket=0), plans)
    assert spy.shapes[0] == (1, 6)
    assert run.exits["r0"].cached_tokens == 30


def test_a_group_is_aligned_to_the_bucket_above_its_longest_suffix(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Suffixes of 5, 9 and 14 (13 to prefill at most) with bucket 8: one unpadded forward of 16 tokens a row; same tokens."""
    params = SamplingParams(max_tokens=8)
    plans, _ = _shared_prefix_plans(model, tok, [5, 9, 14], params)
    pads = PaddingSpy(monkeypatch)
    spy = ForwardSpy(model)
    run = drive(BatchGeneration(spy, tok, prefill_step_size=2048, prefill_bucket=8), plans)
    assert spy.shapes[0] == (3, 16)
    assert not pads.padded
    assert [run.exits[p.row_id].cached_tokens for p in plans] == [len(p.prompt) - 17 for p in plans]
    _check_parity(model, tok, plans, run, params)


def test_a_bucket_past_the_lent_prefix_falls_back_to_the_longest_suffix(model: Any, tok: Any) -> None:
    """Bucket 64 would need 51 tokens back from a 30-token prefix: the group aligns to its longest suffix as without one."""
    params = SamplingParams(max_tokens=6)
    plans, _ = _shared_prefix_plans(model, tok, [5, 14], params)
    spy = ForwardSpy(model)
    drive(BatchGeneration(spy, tok, prefill_step_size=2048, prefill_bucket=64), plans)
    assert spy.shapes[0] == (2, 13)


def test_a_cold_row_is_never_rounded(model: Any, tok: Any) -> None:
    """A row with nothing lent has nothing to re-forward: its forward keeps its length."""
    params = SamplingParams(max_tokens=4)
    plans, _ = _shared_prefix_plans(model, tok, [7], params, cold=0)
    spy = ForwardSpy(model)
    drive(BatchGeneration(spy, tok, prefill_step_size=2048, prefill_bucket=8), plans)
    assert spy.shapes[0] == (1, 36)


def test_the_bucket_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTIER_BATCH_PREFILL_BUCKET: unset 0 off CUDA and 32 on it, a count as given, anything else refused by name."""
    monkeypatch.delenv(PREFILL_BUCKET_ENV, raising=False)
    assert prefill_bucket_setting() == 0  # NOTE: this machine's MLX computes on the CPU.
    assert prefill_bucket_setting(cuda=False) == 0
    assert prefill_bucket_setting(cuda=True) == CUDA_PREFILL_BUCKET == 32
    monkeypatch.setenv(PREFILL_BUCKET_ENV, "0")
    assert prefill_bucket_setting(cuda=True) == 0
    monkeypatch.setenv(PREFILL_BUCKET_ENV, "32")
    assert prefill_bucket_setting() == 32
    for bad in ("-1", "many", "1.5"):
        monkeypatch.setenv(PREFILL_BUCKET_ENV, bad)
        with pytest.raises(ValueError, match=PREFILL_BUCKET_ENV):
            prefill_bucket_setting()
