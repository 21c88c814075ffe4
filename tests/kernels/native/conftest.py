"""The few-row product for the tests of this folder (they skip where it cannot run here).

A kernel that built but failed its own check (it disagrees with MLX, or its
rows change with padding or threads) is a bug, not a platform limit: the
fixtures fail then, in the process that ran the check and in later ones
(the recorded failure names its reason), so a broken kernel never reads as
skipped tests.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import pytest

from kernels.native import few_row_op, few_row_status

CHECK_FAILED = ("disagrees", "failed its check", "change with", "depend on each other")
"""Words of the statuses a failed check leaves (``kernels.native``): a bug, never a skip."""


def unavailable(what: str, status: str) -> None:
    """Fail when ``status`` says a check failed; otherwise skip (the kernel cannot run here)."""
    if any(word in status for word in CHECK_FAILED):
        pytest.fail(f"the {what} failed its check: {status}")
    pytest.skip(f"the {what} does not run here: {status}")


@pytest.fixture(scope="module")
def op() -> Callable[[mx.array, mx.array], mx.array]:
    """The product as kvtier uses it (skips where it cannot run: not x86-64 Linux with AVX2, or no compiler)."""
    fn = few_row_op()
    if fn is None:
        unavailable("few-row product", few_row_status())
    assert fn is not None
    return fn
