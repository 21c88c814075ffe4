"""Pieces of a request of several choices (``n``, a batch of prompts): each choice's sampling and id, a drain.

Each choice is a generation of its own; ``_app.py`` runs them (at most
``HttpSettings.choice_window`` at once) and assembles one answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from messages.gateway import DoneEvent, GenerationParams, TokenEvent

from ._answer import ChatAnswer, CompletionAnswer
from ._port import StreamPort

__all__ = ["CHOICE_EVENTS", "Failure", "choice_id", "choice_params", "drain"]


@dataclass(frozen=True, slots=True)
class Failure:
    """A choice's error event: the stream of several choices ends with it."""

    event: bytes


CHOICE_EVENTS = 64
"""Events the choices of one streamed request may buffer ahead of its writer.

NOTE: bounded: a client that stops reading fills it, and then every choice
waits (its engine request holds its tokens, as a one-choice stream's does).
"""

_SEED_SPAN = 2**63
"""Seeds run over ``0 .. 2**63 - 1`` (``GenerationParams.seed``)."""


def choice_params(params: GenerationParams, j: int) -> GenerationParams:
    """The sampling of a prompt's ``j``-th choice: a seeded request's choice ``j`` draws from ``seed + j``.

    NOTE: one seed for every choice would make a sampled request's ``n``
    answers equal; ``seed + j`` keeps them different and the whole request
    reproducible (choice 0 is the request with ``n`` 1).
    """
    if j == 0 or params.seed is None:
        return params
    return params.model_copy(update={"seed": (params.seed + j) % _SEED_SPAN})


def choice_id(rid: str, c: int) -> str:
    """The engine's id of choice ``c`` (the request's own id for the first)."""
    return rid if c == 0 else f"{rid}-{c}"


async def drain(stream: StreamPort, answer: ChatAnswer | CompletionAnswer) -> DoneEvent | None:
    """Feed a non-streamed ``answer`` every token of ``stream``; its end (``None``: it ended without one)."""
    done: DoneEvent | None = None
    async for event in stream:
        if isinstance(event, TokenEvent):
            answer.feed(event)
        else:
            done = event
    return done
