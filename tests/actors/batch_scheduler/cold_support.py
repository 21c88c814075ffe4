"""Shared pieces of the batch-lane cold-tier tests: a tiny fp32 Llama's identity, engines, runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.engine import DoneEvent, Engine, GenerationParams, TokenEvent
from kernels import ModelIdentity

__all__ = ["IDENTITY", "engine", "ids", "run"]

IDENTITY = ModelIdentity(
    model_id="tiny-llama",
    name="tiny-llama",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    weights_digest="w0",
    dtype="float32",
    quantization=None,
)
"""A fixed identity, so an engine started again finds the files of the one before."""


def ids(tok: Any, text: str) -> list[int]:
    """``text`` as token ids."""
    return [int(t) for t in tok.encode(text)]


def engine(model: Any, tok: Any, root: Path | None, **options: Any) -> Engine:
    """An engine over ``model`` with a 64 MiB RAM tier and the SSD tier at ``root`` (``None``: off)."""
    settings: dict[str, Any] = {"prompt_cache_bytes": 1 << 26, "ssd_cache": root, **options}
    return Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY, **settings)


async def run(
    eng: Engine, prompt: list[int], params: GenerationParams
) -> tuple[list[int], DoneEvent]:
    """One request's token ids and its ``DoneEvent``."""
    tokens: list[int] = []
    async with eng.generate(prompt, params) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
            else:
                return tokens, event
    raise AssertionError("the stream ended without a DoneEvent")
