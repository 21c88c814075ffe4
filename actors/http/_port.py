"""What the HTTP app needs from an engine: a structural slice of ``actors.engine.Engine``.

The app is written against these protocols so its error edge and SSE
plumbing can be unit-tested with a scripted engine; ``kvtier serve`` passes
the real :class:`actors.engine.Engine`, which satisfies them as is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol, Self

from kernels.engine import ToolFormat
from messages.gateway import GenerationEvent, GenerationParams

from ._answer import TokenSpeller

__all__ = ["EnginePort", "StreamPort"]


class StreamPort(Protocol):
    """One request's event stream (``actors.engine.GenerationStream``)."""

    async def start(self) -> None:
        """Admit the request; raises typed admission errors before any event."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def __aiter__(self) -> Self: ...

    async def __anext__(self) -> GenerationEvent: ...

    async def aclose(self) -> None:
        """Cancel the request if it has not finished; idempotent."""
        ...

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the rendered prompt (known once admitted)."""
        ...

    @property
    def readmitted_at(self) -> float | None:
        """When it was last admitted again after a take-back to admission (monotonic); ``None``: never."""
        ...

    @property
    def render_span(self) -> tuple[float, float, float] | None:
        """The prompt render's ask, start (on the loop or a render thread) and end (monotonic); ``None``: none."""
        ...


class EnginePort(Protocol):
    """The engine surface the HTTP app uses."""

    @property
    def model_id(self) -> str:
        """The served model's id."""
        ...

    @property
    def vocab_size(self) -> int | None:
        """Token ids run ``0..vocab_size - 1`` (``None``: unknown, not checked at the edge)."""
        ...

    @property
    def tool_format(self) -> ToolFormat | None:
        """How the model writes tool calls (``None``: it cannot call tools)."""
        ...

    @property
    def token_bytes(self) -> TokenSpeller:
        """Spells token ids as bytes (logprob reports)."""
        ...

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: GenerationParams | None = None,
        *,
        request_id: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        fit_context: bool = False,
    ) -> StreamPort:
        """A not-yet-admitted chat stream (``tools`` go to the chat template)."""
        ...

    def generate(
        self,
        prompt: str | Sequence[int],
        params: GenerationParams | None = None,
        *,
        request_id: str | None = None,
        fit_context: bool = False,
        shared_prompt: bool = False,
    ) -> StreamPort:
        """A not-yet-admitted raw completion stream (``shared_prompt``: siblings over the prompt follow)."""
        ...

    async def stats(self) -> dict[str, Any]:
        """JSON-ready statistics (asked from the actors with a short deadline)."""
        ...

    def begin_shutdown(self) -> None:
        """Stop admission; in-flight streams finish."""
        ...
