"""The few-row product for the tests of this folder (they skip where it cannot run here)."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import pytest

from kernels.native import few_row_op, few_row_status


@pytest.fixture(scope="module")
def op() -> Callable[[mx.array, mx.array], mx.array]:
    """The product as kvtier uses it (skips where it cannot run: not x86-64 Linux with AVX2, or no compiler)."""
    fn = few_row_op()
    if fn is None:
        pytest.skip(f"the few-row product does not run here: {few_row_status()}")
    return fn
