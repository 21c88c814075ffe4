"""What the cold tier's four shells do alike: run their core on one event and the events its
effects' outcomes make, and write a core's warning about a file."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from actors.runtime import Context, get_logger

__all__ = ["feed", "warn_file"]

S = TypeVar("S")
E = TypeVar("E")
F = TypeVar("F")

_log = get_logger("kvtier.ssd_writer")


async def feed(
    ctx: Context,
    handle: Callable[[S, E], tuple[S, Sequence[F]]],
    state: S,
    event: E,
    perform: Callable[[F], Awaitable[E | None]],
) -> S:
    """The one place a shell runs its core: ``event``, then each event its effects' outcomes make.

    Effects are performed in the order returned; an effect whose outcome
    the core needs comes last in its batch, so its event is handled right
    after it (``perform`` returns it). Every call goes through
    ``ctx.traced`` (the live trace). Returns the core's state.
    """
    events: deque[E] = deque([event])
    while events:
        state, effects = ctx.traced(handle, state, events.popleft())
        for effect in effects:
            follow = await perform(effect)
            if follow is not None:
                events.append(follow)
    return state


def warn_file(event: str, path: str, error: str, removed: bool | None) -> None:
    """A core's ``Log`` effect about ``path`` (``removed`` given for a bad file's removal)."""
    if removed is None:
        _log.warning(event, path=path, error=error)
    else:
        _log.warning(event, path=path, error=error, removed=removed)
