"""First token first: the turn that hands out rows' first tokens prefills nothing, and the tokens stay the serial lane's.

NOTE: in mlx-lm's step order (``read_first=False``, the GPU's): read first
hands out a row's first token in the turn it enters, so no turn owes one
(tests/kernels/test_read_first.py).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kernels import SamplingParams
from kernels.engine import FIRST_TOKEN_FIRST_ENV, BatchGeneration
from tests.kernels.test_batch import Plan, _prompts, _serial, drive


def _plans(tok: Any) -> list[Plan]:
    """A short row joining first, a long one (five 8-token chunks) arriving while the first one's first token is owed."""
    (short,) = _prompts(len(tok), 1, seed=31, lo=6, hi=6)
    (long,) = _prompts(len(tok), 1, seed=32, lo=41, hi=41)
    return [
        Plan("a", short, SamplingParams(max_tokens=6)),
        Plan("b", long, SamplingParams(max_tokens=6), join_at=1),
    ]


def test_the_turn_owing_a_first_token_prefills_nothing(model: Any, tok: Any) -> None:
    """Row a entered the decode batch at step 0: step 1 hands out its first token and forwards none of b's prompt; b prefills from step 2."""
    run = drive(BatchGeneration(model, tok, prefill_step_size=8, first_token_first=True, read_first=False), _plans(tok))
    # step 0: a prefills and enters; step 1: a's first token, no prefill.
    assert run.entered[0] == 1
    assert run.steps[1] == (1, 1, 0)
    assert run.steps[2][2] > 0, "b's prefill did not start on the next turn"


def test_switched_off_the_owing_turn_prefills_the_next_row(model: Any, tok: Any) -> None:
    """With the rule off, step 1 hands out a's first token and forwards b's first chunk too."""
    run = drive(BatchGeneration(model, tok, prefill_step_size=8, first_token_first=False, read_first=False), _plans(tok))
    assert run.entered[0] == 1
    assert run.steps[1] == (1, 1, 8)


def test_the_switch_is_read_from_the_environment(model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTIER_BATCH_FIRST_TOKEN_FIRST=0 turns the rule off; unset, it is on."""
    monkeypatch.setenv(FIRST_TOKEN_FIRST_ENV, "0")
    off = drive(BatchGeneration(model, tok, prefill_step_size=8, read_first=False), _plans(tok))
    monkeypatch.delenv(FIRST_TOKEN_FIRST_ENV)
    on = drive(BatchGeneration(model, tok, prefill_step_size=8, read_first=False), _plans(tok))
    assert off.steps[1][2] == 8
    assert on.steps[1][2] == 0


def test_rows_under_the_rule_emit_their_serial_tokens(model: Any, tok: Any) -> None:
    """Staggered joins under the rule: every row's greedy tokens equal its serial run's, and prefill never pauses two turns running."""
    prompts = _prompts(len(tok), 5, seed=44, lo=10, hi=45)
    params = SamplingParams(max_tokens=7)
    plans = [Plan(str(i), p, params, join_at=i) for i, p in enumerate(prompts)]
    run = drive(BatchGeneration(model, tok, prefill_step_size=8, first_token_first=True, read_first=False), plans)
    for i, p in enumerate(prompts):
        assert run.ids(str(i)) == [o.token_id for o in _serial(model, tok, p, params, step=8)]
    # NOTE: a skipped prefill follows a step in which rows entered; the step
    # after it owes nothing, so two prefill-less steps in a row only happen
    # when nothing is left to prefill.
    still_joining = max(run.joined_step.values())
    pauses = [i for i, (_, _, pre) in enumerate(run.steps) if pre == 0 and i <= still_joining]
    assert all(b - a > 1 for a, b in itertools.pairwise(pauses))
