"""Typed errors raised by kvtier's MLX-side kernels.

Each class names the state that made the call impossible. Other kernel
modules may add their classes here (small additive edits); the HTTP edge
maps the ones that reach a client.
"""

from __future__ import annotations

__all__ = [
    "EngineQueueFull",
    "EngineThreadClosed",
    "EngineThreadDead",
    "GenerationFinished",
    "InvalidPrompt",
    "KernelError",
    "NotOnEngineThread",
    "PrefillIncomplete",
]


class KernelError(Exception):
    """Base class of every typed error raised by ``kernels``."""


class EngineThreadClosed(KernelError):
    """The engine thread was closed; it accepts no more jobs."""


class EngineQueueFull(KernelError):
    """The engine thread's bounded submission queue has no free slot."""


class EngineThreadDead(KernelError):
    """The engine thread exited abnormally (a ``BaseException`` escaped a job)."""


class NotOnEngineThread(KernelError):
    """MLX work was attempted outside the engine thread."""


class InvalidPrompt(KernelError, ValueError):
    """A generation cannot start from this prompt / cache combination."""


class PrefillIncomplete(KernelError):
    """``decode_step`` was called before ``prefill_step`` reported completion."""


class GenerationFinished(KernelError):
    """A step was requested from a generation that already has a finish reason."""
