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
    "device_out_of_memory",
]

_OUT_OF_MEMORY = ("out of memory", "unable to allocate", "insufficient memory")
"""What MLX's backends say when an allocation fails: CUDA's ``cudaMallocAsync(...) failed:
out of memory``, the allocator's ``[malloc] Unable to allocate N bytes``, Metal's command
buffer ``Insufficient Memory``."""


def device_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a step's allocation that the device (or host) could not satisfy.

    NOTE: MLX raises a plain ``RuntimeError`` for it, so its text is all there
    is to tell it from a bug; the caller answers it as memory pressure (503,
    retryable) instead of a generation failure (500), and keeps the text.
    """
    if isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _OUT_OF_MEMORY)


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
