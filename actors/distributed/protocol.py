"""What rank 0 sends the other ranks of a tensor-parallel group: one command per engine-thread call.

Every ``Backend`` call of rank 0 that runs a forward or changes what a
rank's KV holds has a command (``Op``); the payloads are JSON. The other
ranks apply them in order to their own ``MlxBackend`` (``follower.py``), so
each rank's generation, prompt-cache entries and their handles follow rank
0's one for one.
"""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Any

from kernels.distributed import Command
from messages.gateway import Generate

__all__ = ["Op", "decode_handles", "decode_open", "encode_handles", "encode_open"]


class Op(IntEnum):
    """Command codes (0 is never sent: it is what a rank that sent nothing contributes)."""

    OPEN = 1
    """Open generation ``gen`` for a request (payload: the request, its reused entry)."""
    STEP = 2
    """One prefill chunk or decode step of ``gen``."""
    SNAPSHOT = 3
    """Register a prompt-boundary snapshot of ``gen`` (payload: rank 0's handle)."""
    REGISTER = 4
    """Take ``gen``'s cache over as an entry and end it (payload: rank 0's handle)."""
    DISCARD = 5
    """End ``gen`` without keeping its cache."""
    DISPOSE = 6
    """Forget entries rank 0's prompt cache disposed (payload: their handles)."""
    STOP = 7
    """Rank 0 stopped serving: leave the loop."""


def encode_open(gen: int, request: Generate, handle: str | None, cached_tokens: int) -> Command:
    """The ``OPEN`` command: the request exactly as rank 0 opened it, and the entry it reused."""
    body = {"request": request.model_dump(mode="json"), "handle": handle, "cached": cached_tokens}
    return Command(Op.OPEN, gen, json.dumps(body, separators=(",", ":")).encode())


def decode_open(payload: bytes) -> tuple[Generate, str | None, int]:
    """The request, reused handle and reused token count of an ``OPEN`` payload."""
    body: Any = json.loads(payload)
    handle = body["handle"]
    cached = body["cached"]
    if handle is not None and not isinstance(handle, str):
        raise ValueError("OPEN: handle is not a string")
    if not isinstance(cached, int) or cached < 0:
        raise ValueError("OPEN: cached is not a count")
    return Generate.model_validate(body["request"]), handle, cached


def encode_handles(op: Op, gen: int, handles: list[str]) -> Command:
    """A command whose payload is a list of rank 0's handles (``SNAPSHOT``/``REGISTER``/``DISPOSE``)."""
    return Command(op, gen, json.dumps(handles).encode())


def decode_handles(payload: bytes) -> list[str]:
    """The handles of a ``SNAPSHOT``/``REGISTER``/``DISPOSE`` payload."""
    body: Any = json.loads(payload)
    if not isinstance(body, list) or not all(isinstance(h, str) for h in body):
        raise ValueError("expected a list of handles")
    return list(body)
