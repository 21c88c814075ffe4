"""The engine thread and what runs on it: generation, sampling, detokenizing.

Every name is re-exported from a private module. All MLX work here runs on
the engine thread.
"""

from __future__ import annotations

from ._detokenize import (
    TextStream,
)
from ._generation import (
    CacheHook,
    Generation,
    KernelFinishReason,
    StepOutput,
    encode_prompt,
    render_chat,
    run_generation,
)
from ._sampling import (
    SamplingParams,
    make_request_processors,
    make_request_sampler,
)
from ._thread import (
    EngineStats,
    EngineThread,
    on_engine_thread,
    require_engine_thread,
)

__all__ = [
    "CacheHook",
    "EngineStats",
    "EngineThread",
    "Generation",
    "KernelFinishReason",
    "SamplingParams",
    "StepOutput",
    "TextStream",
    "encode_prompt",
    "make_request_processors",
    "make_request_sampler",
    "on_engine_thread",
    "render_chat",
    "require_engine_thread",
    "run_generation",
]
