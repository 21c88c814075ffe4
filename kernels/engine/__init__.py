"""The engine thread and what runs on it: generation, sampling, detokenizing.

Every name is re-exported from a private module. All MLX work here runs on
the engine thread.
"""

from __future__ import annotations

from ._batch import (
    BATCH_SSM_ENV,
    BatchFull,
    BatchGate,
    BatchGeneration,
    BatchRefusal,
    BatchStep,
    LayerKind,
    RowExit,
    RowExitReason,
    RowSnapshot,
    RowToken,
    UnknownRow,
    batch_gate,
    batch_ssm_enabled,
    model_batch_gate,
)
from ._detokenize import (
    TextStream,
)
from ._generation import (
    CacheHook,
    Generation,
    KernelFinishReason,
    SnapshotBoundary,
    StepOutput,
    encode_prompt,
    probe_snapshot_boundary,
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
    "BATCH_SSM_ENV",
    "BatchFull",
    "BatchGate",
    "BatchGeneration",
    "BatchRefusal",
    "BatchStep",
    "CacheHook",
    "EngineStats",
    "EngineThread",
    "Generation",
    "KernelFinishReason",
    "LayerKind",
    "RowExit",
    "RowExitReason",
    "RowSnapshot",
    "RowToken",
    "SamplingParams",
    "SnapshotBoundary",
    "StepOutput",
    "TextStream",
    "UnknownRow",
    "batch_gate",
    "batch_ssm_enabled",
    "encode_prompt",
    "make_request_processors",
    "make_request_sampler",
    "model_batch_gate",
    "on_engine_thread",
    "probe_snapshot_boundary",
    "render_chat",
    "require_engine_thread",
    "run_generation",
]
