"""Shared pieces of the generation-checkpoint restart tests: engines, runs, the interrupted first life.

A restart test runs one request three times: uninterrupted with checkpoints
off (the expected answer), on an Engine cancelled after ``cut`` tokens once
``written`` checkpoints are durable (:func:`interrupted_run`), and on a new
Engine on the same SSD directory (:func:`resumed_run`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.checkpoints import CHECKPOINT_DIR
from actors.engine import Engine
from messages.gateway import GenerationParams, TokenEvent
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_tokenizer

__all__ = [
    "EVERY",
    "PROMPT",
    "STORY",
    "STORY_CASES",
    "Interrupted",
    "MakeEngine",
    "default_engine",
    "default_model_restart",
    "files",
    "interrupted_run",
    "resumed_run",
    "section",
    "tiny_engine",
    "tokens",
    "until_removed",
    "until_written",
]

PROMPT = [3 + (i * 7) % 80 for i in range(30)]
EVERY = 8
STORY = ("Write a long, detailed story about a lighthouse keeper who finds a message in a "
         "bottle.\n\nChapter 1.")

STORY_CASES = [
    pytest.param(GenerationParams(max_tokens=80), id="greedy"),
    pytest.param(GenerationParams(max_tokens=80, temperature=0.8, seed=5), id="seeded-0.8"),
]
"""The default model's restart cases: 80 tokens of :data:`STORY`."""

MakeEngine = Callable[[Path | None, int], Engine]
"""``make(root, every)``: an Engine on SSD directory ``root`` (``None``: no SSD tier) checkpointing every ``every`` tokens."""


def tiny_engine(net: Any, root: Path | None, every: int = EVERY, *, max_batch: int = 1,
                **extra: Any) -> Engine:
    """An Engine on the loaded tiny ``net`` (``max_batch`` 1: the serial lane; a fixed identity, so a restart finds the files of the one before)."""
    # NOTE: a stream of 2 events keeps the engine within 3 tokens of its
    # reader, so a cancel lands before the next checkpoint boundary however
    # loaded the machine (with 64 a tiny model ran ahead of a slow reader
    # and took a checkpoint past the cut).
    extra.setdefault("stream_buffer", 2)
    return Engine.from_loaded(net, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                              prompt_cache_bytes=1 << 26, ssd_cache=root, max_batch=max_batch,
                              ssd_writebehind=False, generation_checkpoint=every, **extra)


def default_engine(model: Path, root: Path | None, every: int, *, max_batch: int) -> Engine:
    """The default model, checkpointing every ``every`` tokens under ``root``."""
    return Engine(model=str(model), ssd_cache=root, max_batch=max_batch, ssd_writebehind=False,
                  generation_checkpoint=every)


async def tokens(engine: Engine, params: GenerationParams, *, cancel_after: int | None = None,
                 prompt: Any = PROMPT) -> list[int]:
    """The token ids ``engine`` streams for ``prompt`` (the client cancels after ``cancel_after``)."""
    out: list[int] = []
    async with engine.generate(prompt, params) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                out.append(event.token_id)
                if cancel_after is not None and len(out) == cancel_after:
                    break
    return out


def files(root: Path) -> list[Path]:
    """The checkpoint files under SSD directory ``root``."""
    return sorted(root.glob(f"*/{CHECKPOINT_DIR}/*.kvc"))


async def until_removed(root: Path) -> None:
    """Wait (30 s at most) until no checkpoint file is left under ``root``."""
    with anyio.fail_after(30):
        while True:
            if not files(root):
                return
            await anyio.sleep(0.05)


async def section(engine: Engine) -> dict[str, Any]:
    """``engine``'s ``generation_checkpoints`` statistics."""
    stats = await engine.stats(timeout=5)
    found: dict[str, Any] = stats["generation_checkpoints"]
    return found


async def until_written(engine: Engine, n: int) -> None:
    """Wait (60 s at most) until ``engine`` wrote ``n`` checkpoints."""
    with anyio.fail_after(60):
        while True:
            if (await section(engine))["written"] >= n:
                return
            await anyio.sleep(0.05)


@dataclass(frozen=True)
class Interrupted:
    """The uninterrupted answer and the interrupted Engine's statistics once its checkpoints were durable."""

    expected: list[int]
    stats: dict[str, Any]


async def interrupted_run(make: MakeEngine, root: Path, params: GenerationParams, *,
                          every: int = EVERY, length: int = 40, cut: int = 18,
                          written: int = 2, prompt: Any = PROMPT) -> Interrupted:
    """Answer ``prompt`` with checkpoints off (``length`` tokens), then on ``root`` cancel after ``cut`` tokens and wait for ``written`` checkpoints."""
    async with make(None, 0) as plain:
        expected = await tokens(plain, params, prompt=prompt)
    assert len(expected) == length
    async with make(root, every) as first:
        assert await tokens(first, params, cancel_after=cut, prompt=prompt) == expected[:cut]
        await until_written(first, written)
        stats = await first.stats(timeout=5)
    return Interrupted(expected, stats)


async def resumed_run(make: MakeEngine, root: Path, params: GenerationParams, *,
                      every: int = EVERY, prompt: Any = PROMPT,
                      flush: bool = False) -> tuple[list[int], dict[str, Any]]:
    """A new Engine on ``root`` answers ``prompt``: its tokens and ``/stats`` (then a flush if ``flush``)."""
    async with make(root, every) as second:
        resumed = await tokens(second, params, prompt=prompt)
        stats = await second.stats(timeout=5)
        if flush:
            await second.flush(timeout=30)
    return resumed, stats


async def default_model_restart(model: Path, root: Path, params: GenerationParams, *,
                                max_batch: int) -> dict[str, Any]:
    """The default model cancelled at 70 of 80 tokens (checkpoints at 32, 64) and restarted answers as uninterrupted, 64 tokens saved; the resumed Engine's ``/stats``."""
    def make(at: Path | None, every: int) -> Engine:
        return default_engine(model, at, every, max_batch=max_batch)

    first = await interrupted_run(make, root, params, every=32, length=80, cut=70, prompt=STORY)
    resumed, stats = await resumed_run(make, root, params, every=32, prompt=STORY)
    assert resumed == first.expected
    assert stats["generation_checkpoints"]["resumed"] == 1
    assert stats["generation_checkpoints"]["tokens_saved"] == 64
    return stats
