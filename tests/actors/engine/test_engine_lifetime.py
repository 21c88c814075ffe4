"""Engines come and go, the engine thread stays: each Engine's arrays are freed by its aclose()."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

import mlx.core as mx
import pytest

from actors.engine import Engine, GenerationParams
from kernels import convert_gguf
from tests.model_fixtures import tiny_llama_gguf

pytestmark = pytest.mark.anyio

_CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight llama with a chat template, as an mlx-lm directory."""
    root = tmp_path_factory.mktemp("tiny-model")
    tiny_llama_gguf(root / "tiny.gguf")
    return convert_gguf(root / "tiny.gguf", root / "tiny-mlx", dequantize=True)


async def _serve_two_turns(engine: Engine) -> None:
    first = await engine.complete(_CHAT, GenerationParams(max_tokens=8))
    follow_up = [*_CHAT, {"role": "assistant", "content": first.text}, {"role": "user", "content": "More."}]
    second = await engine.complete(follow_up, GenerationParams(max_tokens=8))
    assert second.usage.cached_tokens > 0, "the second turn should hold a prompt-cache entry"


async def test_aclose_frees_the_engines_model_on_the_engine_thread(tiny_model_dir: Path) -> None:
    """By the time aclose() returns, the Engine's model and cached KV are freed, on the engine thread."""
    before = mx.get_active_memory()
    freed_on: list[str] = []
    engine = Engine(tiny_model_dir, max_queue=2)
    async with engine:
        await _serve_two_turns(engine)
        assert engine._loaded is not None
        weakref.finalize(engine._loaded.model, lambda: freed_on.append(threading.current_thread().name))
        held = mx.get_active_memory() - before
    assert freed_on == ["kvtier-engine"]
    # NOTE: MLX keeps a few bytes of its own per thread (e.g. the random key).
    assert mx.get_active_memory() - before < held // 10


async def test_engines_in_turn_reuse_one_engine_thread_without_growing(tiny_model_dir: Path) -> None:
    """Three Engines opened one after the other run on the same OS thread, and none leaves arrays behind."""
    threads: list[threading.Thread] = []
    after_close: list[int] = []
    for _ in range(3):
        async with Engine(tiny_model_dir, max_queue=2) as engine:
            await _serve_two_turns(engine)
            # NOTE: Thread objects, not idents: a new OS thread may reuse an old ident.
            assert engine._engine_thread is not None
            threads.append(await engine._engine_thread.run(threading.current_thread))
        after_close.append(mx.get_active_memory())
    assert threads[0] is threads[1] is threads[2]
    assert threads[0].is_alive()
    assert after_close[2] == after_close[0]
