"""``kvtier serve`` keeps its start-up heap out of the collector's full walks while it serves, and thaws it before closing."""

from __future__ import annotations

import gc
import socket
from pathlib import Path
from typing import Any

import pytest

import actors.engine
import actors.http
from actors.cli import serve as serve_mod
from actors.cli.heap import startup_heap_frozen
from actors.engine.config import EngineConfig


def test_the_heap_is_frozen_inside_the_block_and_thawed_after() -> None:
    """Inside the block the objects alive at entry are frozen (the yielded count), after it none are."""
    assert gc.get_freeze_count() == 0
    with startup_heap_frozen() as frozen:
        # NOTE: frozen objects still die by reference counting: the count only falls.
        assert frozen >= gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0


def test_thawed_when_the_block_raises() -> None:
    """A failure inside the block still thaws the heap."""
    with pytest.raises(RuntimeError), startup_heap_frozen():
        raise RuntimeError("serving failed")
    assert gc.get_freeze_count() == 0


_SEEN: dict[str, int] = {}
"""The freeze count at each of the scripted engine's lifecycle steps."""


class _Engine:
    """A scripted engine: records the freeze count at each lifecycle step in ``_SEEN``."""

    def __init__(self, *, config: EngineConfig) -> None:
        self.config = config
        self.model_id = "scripted"
        self.final_flush = None
        self.final_flush_error = None

    async def start(self) -> None:
        _SEEN["start"] = gc.get_freeze_count()

    async def drain(self) -> None:
        return None

    async def aclose(self) -> None:
        _SEEN["aclose"] = gc.get_freeze_count()


@pytest.mark.anyio
async def test_serve_freezes_while_serving_and_thaws_before_the_engine_closes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """serve: nothing frozen while the engine starts, the heap frozen while HTTP serves, thawed before aclose."""
    served: list[int] = []

    async def fake_serve(app: Any, sock: socket.socket, **kwargs: Any) -> None:
        served.append(gc.get_freeze_count())

    monkeypatch.setattr(actors.engine, "Engine", _Engine)
    monkeypatch.setattr(actors.http, "create_app", lambda *a, **k: object())
    monkeypatch.setattr(actors.http, "serve", fake_serve)
    _SEEN.clear()
    config = EngineConfig(host="127.0.0.1", port=0, ssd_cache=None)
    assert await serve_mod._serve(config, ()) == 0
    assert _SEEN["start"] == 0
    assert len(served) == 1
    assert served[0] > 1000
    assert _SEEN["aclose"] == 0
    assert gc.get_freeze_count() == 0
