"""The memory guard counts what scoring a prompt (``prompt_logprobs``) adds: the scoring forward and the scores."""

from __future__ import annotations

import pytest

from actors.engine_thread.memory_guard import (
    PROMPT_SCORE_BYTES,
    Footprint,
    MemoryGauge,
    MemoryGuard,
    prompt_scoring_bytes,
)
from actors.errors import MemoryPressure
from kernels.engine import SCORE_ELEMENTS
from messages.gateway import Generate, GenerationParams


def _request(prompt: int, scoring: int | None) -> Generate:
    return Generate(request_id="r", prompt_tokens=tuple(range(prompt)),
                    params=GenerationParams(max_tokens=1, prompt_logprobs=scoring))


def test_scoring_bytes_are_the_forward_bound_plus_each_score() -> None:
    """None adds nothing; k alternatives add the logits bound and (1 + k) scores per token."""
    assert prompt_scoring_bytes(100, None) == 0
    assert prompt_scoring_bytes(100, 0) == 12 * SCORE_ELEMENTS + 100 * PROMPT_SCORE_BYTES
    assert prompt_scoring_bytes(100, 5) == 12 * SCORE_ELEMENTS + 600 * PROMPT_SCORE_BYTES


def test_the_in_turn_guard_refuses_a_scoring_request_the_plain_one_fits() -> None:
    """Same prompt, same budget: the plain request passes, the scoring one is over and refused."""
    footprint = Footprint(kv_bytes_at=lambda n: n * 100, chunk=512)
    budget = footprint.at_prefill(64, 1) + prompt_scoring_bytes(64, 5) - 1
    guard = MemoryGuard(budget=budget, footprint=footprint, gauge=MemoryGauge(lambda: 0))
    guard.before_prefill(_request(64, None), cached_tokens=0)
    with pytest.raises(MemoryPressure):
        guard.before_prefill(_request(64, 5), cached_tokens=0)
    assert guard.refused == 1
