"""Admission renders prompts on ``render_threads`` worker threads at most, in arrival order."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

from actors.engine import Engine, GenerationParams
from tests.kernels.test_generation import lively_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio


class _CountingTemplate:
    """Wraps a tokenizer's ``apply_chat_template``: how many renders ran at once, at most."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)
        try:
            # NOTE: long enough that renders on free threads would overlap.
            time.sleep(0.03)
            return self._inner(*args, **kwargs)
        finally:
            with self._lock:
                self.now -= 1


async def _burst(threads: int, n: int) -> _CountingTemplate:
    tok = tiny_tokenizer()
    counting = _CountingTemplate(tok._tokenizer.apply_chat_template)
    tok._tokenizer.apply_chat_template = counting
    model = lively_llama(len(tok))
    async with Engine.from_loaded(model, tok, model_id="tiny", max_queue=n,
                                  render_threads=threads, render_inline_chars=0) as eng:
        async def one(i: int) -> None:
            async with eng.chat([{"role": "user", "content": f"hat {i}"}],
                                GenerationParams(max_tokens=1)) as stream:
                async for _ in stream:
                    pass

        # NOTE: the first chat also probes the template for its snapshot
        # boundary (renders of its own, not admission's); counted from after it.
        await one(-1)
        counting.most = counting.calls = 0
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
    assert counting.calls == n
    return counting


async def test_a_burst_renders_on_render_threads_at_most() -> None:
    """Eight chats admitted at once render one at a time with render_threads=1, and overlap
    with render_threads=8 (so the bound, not the workload, is what kept them apart)."""
    assert (await _burst(1, 8)).most == 1
    assert (await _burst(8, 8)).most > 1


async def _render_threads_of(inline_chars: int, content: str) -> set[int]:
    """The threads a chat's render ran on, with ``render_inline_chars`` at ``inline_chars``."""
    tok = tiny_tokenizer()
    inner = tok._tokenizer.apply_chat_template
    seen: set[int] = set()

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.add(threading.get_ident())
        return inner(*args, **kwargs)

    tok._tokenizer.apply_chat_template = recording
    async with Engine.from_loaded(lively_llama(len(tok)), tok, model_id="tiny",
                                  render_inline_chars=inline_chars) as eng:
        # NOTE: the first chat also probes the template (renders of its own); counted after it.
        async with eng.chat([{"role": "user", "content": "warm"}], GenerationParams(max_tokens=1)) as s:
            async for _ in s:
                pass
        seen.clear()
        async with eng.chat([{"role": "user", "content": content}], GenerationParams(max_tokens=1)) as s:
            async for _ in s:
                pass
    return seen


async def test_a_short_prompt_renders_on_the_loop_and_a_long_one_on_a_thread() -> None:
    """A chat within render_inline_chars renders on the event loop's thread (no hop that waits
    for the GIL); one past it, or any with the bound at 0, on a worker thread."""
    loop = threading.get_ident()
    assert await _render_threads_of(64, "hat " * 10) == {loop}
    (other,) = await _render_threads_of(64, "hat " * 20)
    assert other != loop
    (zero,) = await _render_threads_of(0, "hat")
    assert zero != loop
