"""Embed kvtier in an async Python app: stream a chat, then reuse its prompt cache.

Run from the repository root (the default model is fetched and converted on
first use; set ``KVTIER_MODEL`` to a local mlx-lm model directory or a
Hugging Face id to use another model):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python docs/examples/embed.py

No ``os._exit`` is needed after the ``async with`` block: the Engine's
engine thread stays parked until the process ends (docs/engine-thread.md).
"""

from __future__ import annotations

import os

import anyio

from actors.engine import Engine, GenerationParams, QueueFull, TokenEvent


async def main(model: str | None) -> None:
    """Stream one answer, then ask a follow-up that reuses the cached prefix."""
    messages = [{"role": "user", "content": "Name three primary colours."}]
    async with Engine(model, max_queue=4) as engine:  # None = the default model
        print(f"model: {engine.model_id}")
        try:
            async with engine.chat(messages, GenerationParams(max_tokens=48)) as stream:
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        print(event.text, end="", flush=True)
                    else:  # DoneEvent: always the last event
                        print(f"\n[{event.finish_reason}] {event.usage}")
                        answer = stream.done
        except QueueFull:
            print("busy, try again later")
            return
        assert answer is not None
        follow_up = await engine.complete(
            [*messages, {"role": "assistant", "content": "Red, yellow and blue."},
             {"role": "user", "content": "And the secondary ones?"}],
            GenerationParams(max_tokens=48),
        )
        print(follow_up.text)
        print(f"cached prompt tokens: {follow_up.usage.cached_tokens} of {follow_up.usage.prompt_tokens}")
        stats = await engine.stats()
        print(f"turns granted: {stats['gateway']['token']['grants']}")


if __name__ == "__main__":
    anyio.run(main, os.environ.get("KVTIER_MODEL") or None)
