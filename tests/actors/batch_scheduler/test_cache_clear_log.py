"""The batch lane's log says when it emptied MLX's buffer cache, and how long after one each join step ran."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from actors.engine import Engine
from kernels import SamplingParams
from kernels.engine import CLEAR_EVERY_ENV
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio


async def _served_logs(monkeypatch: pytest.MonkeyPatch, every: str,
                       answers: int) -> list[MutableMapping[str, Any]]:
    """The log entries of ``answers`` greedy 8-token completions on a served batch lane, emptying every ``every`` steps."""
    monkeypatch.setenv(CLEAR_EVERY_ENV, every)
    tok = tiny_tokenizer()
    model: Any = tiny_llama(vocab_size=len(tok))
    engine = Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY,
                                prompt_cache_bytes=1 << 26, ssd_cache="off", max_batch=4)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with capture_logs() as logs:
        async with engine:
            for k in range(answers):
                await engine.complete_prompt([5 + (i * (k + 3)) % 80 for i in range(24)], params)
    return logs


async def test_cache_emptyings_and_join_steps_are_logged_with_their_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVTIER_BATCH_CLEAR_EVERY=3 on a served batch lane: a batch.cache_cleared line for every third
    step (bytes freed, ms, the step's ms), and each batch.join_step line says how many steps after
    an emptying it ran (1 to 3)."""
    logs = await _served_logs(monkeypatch, "3", 3)
    cleared = [e for e in logs if e["event"] == "batch.cache_cleared"]
    joins = [e for e in logs if e["event"] == "batch.join_step"]
    # NOTE: three answers of 8 tokens run at least 24 steps: 8 emptyings or more.
    assert len(cleared) >= 8, cleared
    for e in cleared:
        assert e["freed_bytes"] >= 0, e
        assert e["clear_ms"] >= 0, e
        assert e["step_ms"] > 0, e
    assert len(joins) == 3
    assert all(1 <= e["since_clear"] <= 3 for e in joins), joins


async def test_with_clear_every_zero_nothing_is_emptied(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTIER_BATCH_CLEAR_EVERY=0: no batch.cache_cleared line, and the steps since one only grow."""
    logs = await _served_logs(monkeypatch, "0", 2)
    assert not [e for e in logs if e["event"] == "batch.cache_cleared"]
    since = [e["since_clear"] for e in logs if e["event"] == "batch.join_step"]
    assert len(since) == 2, since
    assert since[1] > since[0] >= 1, since
