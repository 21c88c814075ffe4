"""Shared test helper: run one request through an ``Engine`` and collect what it streamed."""

from __future__ import annotations

from actors.engine import DoneEvent, Engine, GenerationParams, GenerationStream, TokenEvent

__all__ = ["collect", "drain"]


async def drain(stream: GenerationStream) -> tuple[list[int], DoneEvent]:
    """The token ids ``stream`` (not yet entered) yields and its final event."""
    tokens: list[int] = []
    done: DoneEvent | None = None
    async with stream as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
            else:
                done = event
    assert done is not None
    return tokens, done


async def collect(
    engine: Engine, prompt: list[int], params: GenerationParams
) -> tuple[list[int], DoneEvent]:
    """The token ids ``engine`` streamed for ``prompt`` and its final event."""
    return await drain(engine.generate(prompt, params))
