"""The engine thread and what runs on it: generation, sampling, detokenizing.

Every name is re-exported from a private module. All MLX work here runs on
the engine thread.
"""

from __future__ import annotations

from ._batch import (
    BATCH_SSM_ENV,
    IDLE_PREFILL_ROWS,
    REPLAY_PER_STEP,
    SLOT_REUSE_ENV,
    BatchFull,
    BatchGate,
    BatchGeneration,
    BatchRefusal,
    BatchStep,
    LayerKind,
    RowCheckpoint,
    RowExit,
    RowExitReason,
    RowSnapshot,
    RowToken,
    UnknownRow,
    batch_gate,
    batch_params_refusal,
    batch_ssm_enabled,
    model_batch_gate,
)
from ._blas_threads import (
    BLAS_TUNE_ENV,
    BUSY_FRACTION,
    BlasTuning,
    OpenBlas,
    StepTuning,
    ThreadChooser,
    blas_tune_enabled,
    find_openblas,
    make_blas_tuning,
)
from ._checkpoint import CheckpointPoint
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
from ._grammar_compiler import (
    CHILD_STACK_BYTES,
    COMPILE_STACK_BYTES,
    CompileResult,
    GrammarCompiler,
    default_compiler,
    run_with_stack,
)
from ._grammar_errors import (
    GrammarCompilerBusy,
    GrammarTooComplex,
    InvalidGrammar,
    SchemaTooComplex,
)
from ._greedy import (
    GreedyGenerationBatch,
    argmax_with_logprobs,
    enter_generation,
    greedy_without_logprobs,
    waiting_generation,
)
from ._logprobs import (
    MAX_PROMPT_LOGPROB_ENTRIES,
    SCORE_ELEMENTS,
    PromptScorer,
    TokenBytes,
    prompt_logprob_entries,
    score_rows,
    top_logprobs,
)
from ._sampling import (
    SamplingParams,
    make_request_processors,
    make_request_sampler,
)
from ._schema_limits import (
    SchemaLimits,
    SchemaStats,
    check_schemas,
)
from ._schema_rewrite import (
    strict_schema,
)
from ._structured import (
    GrammarProcessor,
    GrammarViolation,
    check_grammar,
    json_schema_grammar,
    prepare_grammar,
    tool_call_grammar,
)
from ._thread import (
    EngineStats,
    EngineThread,
    on_engine_thread,
    require_engine_thread,
)
from ._tools import (
    ParsedToolCall,
    ToolCallSplitter,
    ToolFormat,
    ToolSegment,
    parse_tool_call,
    tool_format,
)
from ._transitioning import (
    TransitioningBatchKVCache,
)

__all__ = [
    "BATCH_SSM_ENV",
    "BLAS_TUNE_ENV",
    "BUSY_FRACTION",
    "CHILD_STACK_BYTES",
    "COMPILE_STACK_BYTES",
    "IDLE_PREFILL_ROWS",
    "MAX_PROMPT_LOGPROB_ENTRIES",
    "REPLAY_PER_STEP",
    "SCORE_ELEMENTS",
    "SLOT_REUSE_ENV",
    "BatchFull",
    "BatchGate",
    "BatchGeneration",
    "BatchRefusal",
    "BatchStep",
    "BlasTuning",
    "CacheHook",
    "CheckpointPoint",
    "CompileResult",
    "EngineStats",
    "EngineThread",
    "Generation",
    "GrammarCompiler",
    "GrammarCompilerBusy",
    "GrammarProcessor",
    "GrammarTooComplex",
    "GrammarViolation",
    "GreedyGenerationBatch",
    "InvalidGrammar",
    "KernelFinishReason",
    "LayerKind",
    "OpenBlas",
    "ParsedToolCall",
    "PromptScorer",
    "RowCheckpoint",
    "RowExit",
    "RowExitReason",
    "RowSnapshot",
    "RowToken",
    "SamplingParams",
    "SchemaLimits",
    "SchemaStats",
    "SchemaTooComplex",
    "SnapshotBoundary",
    "StepOutput",
    "StepTuning",
    "TextStream",
    "ThreadChooser",
    "TokenBytes",
    "ToolCallSplitter",
    "ToolFormat",
    "ToolSegment",
    "TransitioningBatchKVCache",
    "UnknownRow",
    "argmax_with_logprobs",
    "batch_gate",
    "batch_params_refusal",
    "batch_ssm_enabled",
    "blas_tune_enabled",
    "check_grammar",
    "check_schemas",
    "default_compiler",
    "encode_prompt",
    "enter_generation",
    "find_openblas",
    "greedy_without_logprobs",
    "json_schema_grammar",
    "make_blas_tuning",
    "make_request_processors",
    "make_request_sampler",
    "model_batch_gate",
    "on_engine_thread",
    "parse_tool_call",
    "prepare_grammar",
    "probe_snapshot_boundary",
    "prompt_logprob_entries",
    "render_chat",
    "require_engine_thread",
    "run_generation",
    "run_with_stack",
    "score_rows",
    "strict_schema",
    "tool_call_grammar",
    "tool_format",
    "top_logprobs",
    "waiting_generation",
]
