"""The few-row product (kernels.native): its numbers, row independence, threads, views, and the switch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kernels.native import (
    FEW_ROW_ENV,
    NativeUnavailable,
    cpu_supports_kernel,
    few_row_enabled,
    few_row_threads,
    load_extension,
)

Op = Callable[[mx.array, mx.array], mx.array]



@pytest.fixture(scope="module")
def module(op: Op) -> Any:
    """The compiled module itself (for its thread-count argument)."""
    return load_extension()


def _data(m: int, k: int, n: int, seed: int) -> tuple[mx.array, mx.array]:
    kx, kw = mx.random.split(mx.random.key(seed))
    return mx.random.normal((m, k), key=kx), mx.random.normal((n, k), key=kw)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 10), (3, 203, 37), (8, 576, 130), (11, 17, 5)])
def test_product_equals_mlx_within_rounding(op: Op, m: int, k: int, n: int) -> None:
    """x @ w.T to float32 rounding, for row counts past the 4-row blocks and K not a multiple of 8."""
    x, w = _data(m, k, n, seed=m)
    got, ref = op(x, w), x @ w.T
    assert got.shape == (m, n)
    assert got.dtype == mx.float32
    assert mx.allclose(got, ref, rtol=1e-5, atol=1e-4).item()


def test_each_row_is_computed_alone(op: Op) -> None:
    """A row's output has the same bits alone, among 9 rows, or among other rows (what batch == serial needs)."""
    x, w = _data(9, 203, 70, seed=3)
    together = op(x, w)
    other = mx.concatenate([mx.random.normal((5, 203), key=mx.random.key(9)), x[6:7]], axis=0)
    for i in range(9):
        assert mx.array_equal(op(x[i : i + 1], w)[0], together[i]).item(), f"row {i} alone"
    assert mx.array_equal(op(other, w)[5], together[6]).item()


def test_thread_counts_give_the_same_bits(module: Any) -> None:
    """1, 2 and 3 threads split the weight rows differently and give identical outputs."""
    x, w = _data(6, 160, 101, seed=4)
    outs = [module.few_row(x, w, t) for t in (1, 2, 3)]
    mx.eval(outs)
    assert mx.array_equal(outs[0], outs[1]).item()
    assert mx.array_equal(outs[0], outs[2]).item()


def test_views_and_leading_axes(op: Op) -> None:
    """A strided or transposed input is made contiguous first; leading axes are kept (batch, 1, K)."""
    x, w = _data(4, 96, 33, seed=5)
    wide = mx.repeat(x, 2, axis=1)  # every column twice
    strided = wide[:, ::2]
    assert mx.array_equal(op(strided, w), op(x, w)).item()
    transposed = mx.array(x.T).T
    assert mx.array_equal(op(transposed, w), op(x, w)).item()
    batched = x.reshape(4, 1, 96)
    out = op(batched, w)
    assert out.shape == (4, 1, 33)
    assert mx.array_equal(out.reshape(4, 33), op(x, w)).item()


def test_inside_a_lazy_graph(op: Op) -> None:
    """The product is a node of MLX's graph: built lazily, evaluated with what feeds it."""
    x, w = _data(2, 64, 300, seed=6)
    got = mx.argmax(op(mx.sin(x) * 3.0, w), axis=-1)
    ref = mx.argmax((mx.sin(x) * 3.0) @ w.T, axis=-1)
    assert got.tolist() == ref.tolist()


def test_wrong_dtypes_and_shapes_are_refused(op: Op) -> None:
    """float16 inputs and mismatched inner sizes raise instead of computing garbage."""
    x, w = _data(2, 64, 8, seed=7)
    with pytest.raises(ValueError):
        op(x.astype(mx.float16), w)
    with pytest.raises(ValueError):
        op(x[:, :60], w)


def test_switch_and_thread_settings() -> None:
    """KVTIER_FEW_ROW=0 turns it off; KVTIER_FEW_ROW_THREADS is 1-16, else an error; default 1-8."""
    assert not few_row_enabled({FEW_ROW_ENV: "0"})
    assert not few_row_enabled({FEW_ROW_ENV: "off"})
    assert few_row_enabled({})
    assert few_row_threads({"KVTIER_FEW_ROW_THREADS": "3"}) == 3
    assert 1 <= few_row_threads({}) <= 8
    for bad in ("0", "17", "two"):
        with pytest.raises(ValueError):
            few_row_threads({"KVTIER_FEW_ROW_THREADS": bad})


def test_a_failed_build_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a compiler that fails, loading raises NativeUnavailable naming the step; nothing is cached."""
    if not cpu_supports_kernel():
        with pytest.raises(NativeUnavailable, match="AVX2"):
            load_extension(tmp_path)
        return
    monkeypatch.setenv("CC", "false")
    with pytest.raises(NativeUnavailable, match="building the few-row extension failed"):
        load_extension(tmp_path)
    assert not list(tmp_path.rglob("*.so"))


def test_weights_that_are_views_or_lazy(op: Op) -> None:
    """A transposed (not row-contiguous) or not yet evaluated weight gives the same bits as the plain one."""
    x, w = _data(3, 80, 41, seed=8)
    mx.eval(w)
    transposed = mx.array(w.T).T
    lazy = w * 1.0
    ref = op(x, w)
    assert mx.array_equal(op(x, transposed), ref).item()
    assert mx.array_equal(op(x, lazy), ref).item()
