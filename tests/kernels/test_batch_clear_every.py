"""The batch lane's periodic emptying of MLX's buffer cache: its cadence, its switch, what each step reports."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kernels import SamplingParams
from kernels.engine import (
    CLEAR_EVERY_ENV,
    DEFAULT_CLEAR_EVERY,
    BatchGeneration,
    BatchStep,
    clear_every_setting,
)


def _steps(model: Any, tok: Any, clear_every: int | None, monkeypatch: pytest.MonkeyPatch,
           clears: list[int]) -> list[BatchStep]:
    """One row of 9 new tokens stepped to its end, ``mx.clear_cache`` counted (and still run)."""
    real = mx.clear_cache

    def counted() -> None:
        clears.append(len(steps))
        real()

    monkeypatch.setattr(mx, "clear_cache", counted)
    batch = BatchGeneration(model, tok, prefill_step_size=2048, clear_every=clear_every)
    batch.join("r0", tok.encode("a prompt of a few tokens"), SamplingParams(max_tokens=9))
    steps: list[BatchStep] = []
    while not batch.idle:
        steps.append(batch.step())
        assert len(steps) < 50, "the batch did not drain"
    return steps


def test_the_cache_is_emptied_after_every_nth_step_and_each_step_says_so(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """clear_every=3: MLX's cache emptied at the end of steps 3, 6, 9 only; each step reports the
    steps since the last emptying (itself included) and, on an emptying step, the bytes and time."""
    clears: list[int] = []
    steps = _steps(model, tok, 3, monkeypatch, clears)
    assert len(steps) >= 9
    emptied = [i for i, s in enumerate(steps) if s.cleared]
    assert emptied == [i for i in range(len(steps)) if (i + 1) % 3 == 0]
    assert clears == emptied
    assert [s.since_clear for s in steps] == [i % 3 + 1 for i in range(len(steps))]
    assert all(s.clear_s > 0 and s.cleared_bytes >= 0 for s in steps if s.cleared)
    assert all(s.cleared_bytes == 0 and s.clear_s == 0 for s in steps if not s.cleared)


def test_clear_every_zero_never_empties_the_cache(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """clear_every=0: no step empties MLX's cache; the count since the last emptying only grows."""
    clears: list[int] = []
    steps = _steps(model, tok, 0, monkeypatch, clears)
    assert clears == []
    assert not any(s.cleared or s.clear_s or s.cleared_bytes for s in steps)
    assert [s.since_clear for s in steps] == list(range(1, len(steps) + 1))


def test_the_cadence_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTIER_BATCH_CLEAR_EVERY: unset the default (mlx-lm's old 256), a count as given, 0 never,
    anything else refused by name."""
    monkeypatch.delenv(CLEAR_EVERY_ENV, raising=False)
    assert clear_every_setting() == DEFAULT_CLEAR_EVERY == 256
    monkeypatch.setenv(CLEAR_EVERY_ENV, "512")
    assert clear_every_setting() == 512
    monkeypatch.setenv(CLEAR_EVERY_ENV, "0")
    assert clear_every_setting() == 0
    for bad in ("-1", "often", "2.5"):
        monkeypatch.setenv(CLEAR_EVERY_ENV, bad)
        with pytest.raises(ValueError, match=CLEAR_EVERY_ENV):
            clear_every_setting()


def test_a_negative_cadence_is_refused(model: Any, tok: Any) -> None:
    """clear_every < 0 given directly is a ValueError, not a lane that never (or always) empties."""
    with pytest.raises(ValueError, match="clear_every"):
        BatchGeneration(model, tok, clear_every=-1)
