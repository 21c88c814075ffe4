"""The start-up warm-up runs the batch lane's kinds of step on short prompts and leaves nothing behind."""

from __future__ import annotations

from typing import Any

import pytest

from kernels import SamplingParams
from kernels.engine import BatchGeneration, warm_up
from tests.kernels.test_batch import Plan, _prompts, drive
from tests.kernels.test_generation import lively_llama
from tests.tiny_models import tiny_gemma3, tiny_mamba


def _tokens(model: Any, tok: Any) -> dict[str, list[int]]:
    """Three greedy rows through a fresh batch: their token ids by row."""
    prompts = _prompts(len(tok), 3, seed=71, lo=9, hi=30)
    plans = [Plan(str(i), p, SamplingParams(max_tokens=6), join_at=i) for i, p in enumerate(prompts)]
    run = drive(BatchGeneration(model, tok, prefill_step_size=8), plans)
    return {str(i): run.ids(str(i)) for i in range(len(prompts))}


def test_the_pass_runs_a_cold_row_then_warm_rows_beside_a_decoding_one(tok: Any) -> None:
    """Four rows run to their ends: the cold one with its snapshot, two over lent prefixes, one decoding."""
    model = lively_llama(len(tok), seed=5)
    report = warm_up(model, tok, prefill_step_size=16)
    assert report.skipped is None
    assert (report.rows, report.warm_rows, report.snapshots) == (4, 2, 1)
    # NOTE: a step per token at least: the cold row's 4, then the decoding row's 12.
    assert report.steps >= 4 + 12
    assert report.seconds > 0.0


def test_the_pass_changes_no_later_answer(tok: Any) -> None:
    """The same rows give the same greedy tokens before and after a warm-up on the same model."""
    model = lively_llama(len(tok), seed=6)
    before = _tokens(model, tok)
    warm_up(model, tok, prefill_step_size=16)
    assert _tokens(model, tok) == before


@pytest.mark.parametrize("kind", ["gemma3", "mamba"])
def test_other_layer_kinds_warm_up_too(tok: Any, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliding-window layers, and recurrent state (lent whole: it cannot be shortened), run the pass."""
    monkeypatch.setenv("KVTIER_BATCH_SSM", "1")
    model = tiny_gemma3(vocab_size=len(tok)) if kind == "gemma3" else tiny_mamba(vocab_size=len(tok))
    report = warm_up(model, tok, prefill_step_size=16)
    assert (report.skipped, report.rows, report.warm_rows) == (None, 4, 2)


def test_a_model_the_batch_lane_refuses_runs_nothing(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With recurrent rows switched off, a Mamba model's pass is skipped with the lane's reason."""
    monkeypatch.setenv("KVTIER_BATCH_SSM", "0")
    report = warm_up(tiny_mamba(vocab_size=len(tok)), tok)
    assert report.skipped == "recurrent_disabled"
    assert (report.steps, report.rows) == (0, 0)


def test_a_quantizing_kv_scheme_warms_up_too(tok: Any) -> None:
    """Under 4-bit KV (transitioning rows) the pass runs all four rows to their ends, two of them
    over a lent prefix."""
    import mlx.core as mx

    from tests.kernels.test_batch_transitioning import KV4, _lively
    from tests.tiny_models import tiny_llama

    model = _lively(tiny_llama(vocab_size=len(tok), head_dim=32, dtype=mx.float32, seed=1))
    report = warm_up(model, tok, kv_scheme=KV4, prefill_step_size=16)
    assert (report.skipped, report.rows, report.warm_rows) == (None, 4, 2)
