"""The turn runner's ports and the values that cross them.

``Executor`` runs a callable on the engine thread (``kernels.EngineThread``
in serving; :class:`InlineExecutor` in simulation and scripted tests).
``Backend`` is the engine-thread half of a request: every method runs ON
the engine thread (``actors.backend.MlxBackend`` in serving; scripted fakes
in the gateway's tests). ``StepResult``/``StepToken``/``Registered`` are
what a backend hands back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from messages.gateway import Generate, PromptLogprobs
from messages.prompt_cache import EntryMeta

__all__ = ["Backend", "Executor", "InlineExecutor", "Registered", "StepResult", "StepToken"]

T = TypeVar("T")


class Executor(Protocol):
    """Runs callables on the engine thread, one at a time, in submission order."""

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn(*args)`` NOW; the future (of the running loop) settles with its outcome.

        Raises at once if the executor takes no more jobs (closed, dead).
        """
        ...


class InlineExecutor:
    """Runs each job inline, on the caller's (the loop's) thread: simulation and scripted tests only."""

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Call ``fn(*args)`` now; the returned future already holds its outcome."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - handed to the awaiter, like the engine thread
            future.set_exception(exc)
        return future


@dataclass(frozen=True, slots=True)
class StepToken:
    """One generated token and the text it released (log-probabilities when asked).

    ``prompt_logprobs``: the prompt's scores, with the first token, when asked.
    """

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step of a request did on the engine thread."""

    phase: Literal["prefill", "decode"]
    token: StepToken | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prefill_complete: bool = False
    snapshot_point: bool | None = None
    """True on the step after which the live cache holds exactly the prompt's stable
    boundary (where the prompt-boundary snapshot is taken, docs/prompt-cache.md);
    ``None``: the backend does not say, and the prefill's end is that point."""


@dataclass(frozen=True, slots=True)
class Registered:
    """A cache entry registered on the engine thread: its handle, facts and exact tokens."""

    handle: str
    meta: EntryMeta
    tokens: tuple[int, ...]


class Backend(Protocol):
    """The engine-thread half of request turns. Every method runs ON the engine thread."""

    def open(
        self,
        request: Generate,
        handle: str | None,
        cached_tokens: int,
        *,
        staging_id: str | None = None,
    ) -> Any:
        """A fresh generation state for ``request`` (reusing ``handle``'s first tokens if given).

        With ``staging_id`` the first ``cached_tokens`` come instead from an
        SSD entry the cold tier restored into host memory: the backend
        materializes it into MLX arrays and trims it. The state's
        ``cached_tokens`` says how many prompt tokens it really reused: a
        backend that cannot materialize the entry falls back to a cold
        prefill (0), because a cache-tier failure is a miss.
        """
        ...

    def step(self, gen: Any) -> StepResult:
        """One prefill chunk (until the prefill completes) or one decode step."""
        ...

    def snapshot(self, gen: Any) -> Registered | None:
        """Register a prompt-only clone of the live cache (``None``: nothing worth keeping)."""
        ...

    def register(self, gen: Any) -> Registered | None:
        """Take the live cache over as an entry (``None``: nothing worth keeping)."""
        ...

    def discard(self, gen: Any) -> None:
        """Drop ``gen``'s arrays (on the engine thread) without keeping anything."""
        ...

    def end_turn(self) -> None:
        """Housekeeping after every engine job (e.g. drop arrays of disposed cache handles)."""
        ...
