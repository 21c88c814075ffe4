"""Native code kvtier builds on this machine: the few-row product of one-token CPU steps, and a softmax for CPU attention.

Every name is re-exported from a private module. See ``_build.py`` for how
the extension is built and cached, ``_few_row.py`` for the operation.
"""

from __future__ import annotations

from ._build import (
    FAILURE_RECORD,
    MODULE_NAME,
    NativeUnavailable,
    cpu_supports_kernel,
    discard_build,
    extension_dir,
    load_extension,
    toolchain_identity,
)
from ._few_row import (
    FEW_ROW_ENV,
    FEW_ROW_THREADS_ENV,
    few_row_enabled,
    few_row_op,
    few_row_status,
    few_row_threads,
)
from ._softmax import (
    NATIVE_SOFTMAX_ENV,
    MaskedSoftmax,
    causal_softmax_op,
    masked_softmax_op,
    native_softmax_enabled,
    softmax_op,
    softmax_status,
)

__all__ = [
    "FAILURE_RECORD",
    "FEW_ROW_ENV",
    "FEW_ROW_THREADS_ENV",
    "MODULE_NAME",
    "NATIVE_SOFTMAX_ENV",
    "MaskedSoftmax",
    "NativeUnavailable",
    "causal_softmax_op",
    "cpu_supports_kernel",
    "discard_build",
    "extension_dir",
    "few_row_enabled",
    "few_row_op",
    "few_row_status",
    "few_row_threads",
    "load_extension",
    "masked_softmax_op",
    "native_softmax_enabled",
    "softmax_op",
    "softmax_status",
    "toolchain_identity",
]
