"""``Engine.start`` runs the batch lane's warm-up before it is ready where ``warm_up`` asks for it."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from actors.engine import Engine, GenerationParams
from tests.kernels.test_generation import lively_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio


async def _answer(warm_up: Any) -> tuple[list[int], list[MutableMapping[str, Any]]]:
    """A greedy chat's token ids from a fresh engine, and the warm-up log lines of its start."""
    tok = tiny_tokenizer()
    model = lively_llama(len(tok), seed=8)
    with capture_logs() as logs:
        async with (
            Engine.from_loaded(model, tok, model_id="tiny", max_batch=4, warm_up=warm_up) as eng,
            eng.chat([{"role": "user", "content": "warm hat"}], GenerationParams(max_tokens=6)) as stream,
        ):
            ids = [e.token_id async for e in stream if hasattr(e, "token_id")]
    return ids, [e for e in logs if e["event"] == "engine.warm_up"]


async def test_on_the_pass_runs_at_start_and_the_answer_is_unchanged() -> None:
    """warm_up="on": one engine.warm_up line with its four rows, two over lent prefixes; the
    chat's greedy tokens equal those of an engine started without it; auto on the CPU runs none."""
    warmed, lines = await _answer("on")
    assert len(lines) == 1
    assert (lines[0]["skipped"], lines[0]["rows"], lines[0]["warm_rows"]) == (None, 4, 2)
    plain, none = await _answer("auto")
    assert none == []
    assert warmed == plain
    assert len(plain) == 6


class _Mute:
    """The tiny tokenizer, but its ``encode`` finds no tokens (the warm-up has no prompt to run)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)


async def test_a_failed_pass_fails_the_start_and_says_how_to_skip_it() -> None:
    """The pass's error ends the start (nothing hides it), after a line naming --warm-up off."""
    tok = tiny_tokenizer()
    with capture_logs() as logs, pytest.raises(ValueError, match="no tokens"):
        async with Engine.from_loaded(lively_llama(len(tok), seed=8), _Mute(tok), model_id="tiny",
                                      warm_up="on"):
            pass
    (line,) = [e for e in logs if e["event"] == "engine.warm_up_failed"]
    assert "--warm-up off" in line["hint"]
