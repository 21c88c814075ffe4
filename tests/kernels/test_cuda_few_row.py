"""The CUDA few-row product: its switch, what it routes, MLX's product wherever it does not fit; on CUDA, its numbers."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kernels._memory import on_cuda
from kernels.model import FewRowLinear, _cuda_few_row, apply_few_row
from kernels.model._cuda_few_row import (
    CUDA_FEW_ROW_ENV,
    cuda_few_row_enabled,
    few_row_product,
    fits,
)
from tests.tiny_models import tiny_llama


def test_the_switch_is_off_unless_asked_for() -> None:
    """Unset or an off word keeps MLX's products; ``1`` turns the kernel on."""
    assert not cuda_few_row_enabled({})
    assert not cuda_few_row_enabled({CUDA_FEW_ROW_ENV: "0"})
    assert cuda_few_row_enabled({CUDA_FEW_ROW_ENV: "1"})


def test_a_variant_name_turns_it_on_and_picks_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``quad`` / ``tile`` ask for the kernel and name the one it runs; an on word keeps the default."""
    monkeypatch.setattr(_cuda_few_row, "variant", "tile")
    assert cuda_few_row_enabled({CUDA_FEW_ROW_ENV: "quad"})
    assert _cuda_few_row.requested_variant({CUDA_FEW_ROW_ENV: "quad"}) == "quad"
    assert _cuda_few_row.requested_variant({CUDA_FEW_ROW_ENV: "1"}) == "tile"
    _cuda_few_row.use_variant("quad")
    assert _cuda_few_row.variant == "quad"
    with pytest.raises(ValueError, match="unknown few-row kernel"):
        _cuda_few_row.use_variant("wide")


def test_only_the_weights_of_the_named_dtype_are_routed() -> None:
    """bf16 routes a bf16 model's 7 linears a layer plus its tied head; an fp32 model is left as it is."""
    model = tiny_llama(seed=1, dtype=mx.bfloat16)
    layers = len(model.layers)
    assert apply_few_row(model, few_row_product, dtype=mx.bfloat16) == 7 * layers + 1
    assert isinstance(model.layers[0].mlp.down_proj, FewRowLinear)
    fp32 = tiny_llama(seed=1, dtype=mx.float32)
    assert apply_few_row(fp32, few_row_product, dtype=mx.bfloat16) == 0


@pytest.mark.skipif(on_cuda(), reason="checks the fallback where CUDA is not the device")
def test_off_cuda_the_product_is_mlxs_bit_for_bit() -> None:
    """Without CUDA nothing fits, and the product is ``x @ w.T`` itself."""
    w = mx.random.normal((64, 128), key=mx.random.key(1)).astype(mx.bfloat16)
    x = mx.random.normal((4, 1, 128), key=mx.random.key(2)).astype(mx.bfloat16)
    assert not fits(x, w)
    assert mx.array_equal(few_row_product(x, w), x @ w.T).item()


@pytest.mark.skipif(
    on_cuda(), reason="the shape rules, checked off CUDA (where the device rule is False)"
)
def test_shapes_it_refuses() -> None:
    """Mismatched K, more than 8 rows, K not a multiple of 32 or N of 16, fp32: never the kernel."""
    w = mx.zeros((64, 128), dtype=mx.bfloat16)
    assert not fits(mx.zeros((2, 96), dtype=mx.bfloat16), w)
    assert not fits(mx.zeros((9, 128), dtype=mx.bfloat16), w)
    assert not fits(mx.zeros((2, 120), dtype=mx.bfloat16), mx.zeros((64, 120), dtype=mx.bfloat16))
    assert not fits(mx.zeros((2, 128), dtype=mx.bfloat16), mx.zeros((60, 128), dtype=mx.bfloat16))
    assert not fits(mx.zeros((2, 128)), mx.zeros((64, 128)))


@pytest.mark.skipif(not on_cuda(), reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 14336), (49152, 4096)])
def test_on_cuda_rows_match_the_reference_and_each_other(
    shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within bf16 rounding of an fp32 reference, and every row bit for bit the same alone or with 7 others."""
    monkeypatch.setattr(_cuda_few_row, "min_rows", 1)
    n, k = shape
    w = mx.random.normal((n, k), key=mx.random.key(n)).astype(mx.bfloat16)
    x = mx.random.normal((8, k), key=mx.random.key(k)).astype(mx.bfloat16)
    assert fits(x, w)
    assert fits(x[:1], w)
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
    got = few_row_product(x, w).astype(mx.float32)
    err = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
    assert isinstance(err, float)
    assert err < 1e-2
    for i in range(8):
        assert mx.array_equal(
            few_row_product(x[i : i + 1], w), few_row_product(x, w)[i : i + 1]
        ).item()


@pytest.mark.skipif(not on_cuda(), reason="the kernel runs on CUDA only")
def test_on_cuda_one_row_stays_on_mlxs_product() -> None:
    """Below ``min_rows`` (one row by default) the product is MLX's own, bit for bit."""
    w = mx.random.normal((4096, 4096), key=mx.random.key(3)).astype(mx.bfloat16)
    x = mx.random.normal((1, 1, 4096), key=mx.random.key(4)).astype(mx.bfloat16)
    assert not fits(x, w)
    assert mx.array_equal(few_row_product(x, w), x @ w.T).item()


@pytest.mark.skipif(on_cuda(), reason="checks the answer where CUDA is not the device")
def test_the_self_check_refuses_off_cuda() -> None:
    """Off CUDA the self-check names why the kernel cannot run."""
    assert _cuda_few_row.self_check() == "CUDA is not the default device"


@pytest.mark.skipif(not on_cuda(), reason="the kernel runs on CUDA only")
def test_on_cuda_the_self_check_passes() -> None:
    """On a CUDA device of compute capability 8.0 or more the kernel compiles and agrees with MLX."""
    assert _cuda_few_row.self_check() is None


def _load_as_if_on_cuda(
    monkeypatch: pytest.MonkeyPatch, refusal: str | None, *, qkv_refusal: str | bool | None = False
) -> tuple[Any, Any]:
    """A bf16 tiny model through the load's CUDA branch, with the given self-check answers.

    ``qkv_refusal``: ``False`` leaves q|k|v unasked; ``None`` or a reason asks
    for it and answers its self-check so.
    """
    from kernels.model import _loading, transform_for_device

    monkeypatch.setattr(_loading, "on_cuda", lambda: True)
    monkeypatch.setattr(_loading, "cuda_few_row_enabled", lambda: True)
    monkeypatch.setattr(_loading, "cuda_few_row_check", lambda: refusal)
    monkeypatch.setattr(_loading, "qkv_enabled", lambda: qkv_refusal is not False)
    monkeypatch.setattr(_loading, "cuda_few_row_qkv_check", lambda: qkv_refusal or None)
    monkeypatch.setattr(_cuda_few_row, "variant", _cuda_few_row.variant)
    model = tiny_llama(seed=1, dtype=mx.bfloat16)
    report = transform_for_device(model, fuse=False, few_row=False)
    assert report is not None
    return model, report


@pytest.mark.parametrize("refusal", [None, "the 'tile' kernel did not run here: no mma"])
def test_the_load_routes_products_only_when_the_self_check_passes(
    refusal: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked for on CUDA, a refused self-check routes nothing and says why; a passed one routes every bf16 product."""
    model, report = _load_as_if_on_cuda(monkeypatch, refusal)
    if refusal is None:
        assert report.few_row == 7 * len(model.layers) + 1
        assert report.few_row_status == "CUDA few-row product"
    else:
        assert report.few_row == 0
        assert report.few_row_status == refusal
        assert not isinstance(model.layers[0].mlp.down_proj, FewRowLinear)


def test_qkv_joins_each_bf16_layer_and_leaves_fp32_alone() -> None:
    """A bf16 model's q, k, v become members of one launch a layer; an fp32 model is left as it is."""
    model = tiny_llama(seed=1, dtype=mx.bfloat16)
    assert _cuda_few_row.apply_qkv(model) == len(model.layers)
    assert isinstance(model.layers[0].self_attn.k_proj, _cuda_few_row.QkvMember)
    assert _cuda_few_row.apply_qkv(tiny_llama(seed=1, dtype=mx.float32)) == 0


def test_qkv_launches_once_a_layer_for_a_decode_step_and_never_for_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One launch per layer per one-position input, its three outputs to their members; prefill keeps MLX's."""
    calls: list[tuple[int, ...]] = []

    def counting(x: mx.array, ws: tuple[mx.array, mx.array, mx.array]) -> list[mx.array]:
        calls.append(tuple(x.shape))
        return [x @ w.T for w in ws]

    monkeypatch.setattr(_cuda_few_row, "qkv_product", counting)
    plain = tiny_llama(seed=1, dtype=mx.bfloat16)
    joined = tiny_llama(seed=1, dtype=mx.bfloat16)
    _cuda_few_row.apply_qkv(joined)
    prompt = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    out = []
    for m in (plain, joined):
        cache = make_prompt_cache(m)
        m(prompt, cache=cache)
        assert calls == []
        out.append(m(mx.array([[5]]), cache=cache)[0, -1])
    assert len(calls) == len(joined.layers)
    assert mx.array_equal(out[0], out[1]).item()


def test_the_qkv_self_check_refuses_off_cuda() -> None:
    """Off CUDA the q|k|v self-check names why."""
    if on_cuda():
        pytest.skip("checks the answer where CUDA is not the device")
    assert _cuda_few_row.self_check_qkv() == "CUDA is not the default device"


@pytest.mark.skipif(not on_cuda(), reason="the kernel runs on CUDA only")
def test_on_cuda_qkv_equals_three_products_bit_for_bit() -> None:
    """The one launch runs the "tile" body on each weight: the same bits as three separate calls."""
    keys = mx.random.split(mx.random.key(5), 4)
    ws = (
        mx.random.normal((4096, 4096), key=keys[0]).astype(mx.bfloat16),
        mx.random.normal((1024, 4096), key=keys[1]).astype(mx.bfloat16),
        mx.random.normal((1024, 4096), key=keys[2]).astype(mx.bfloat16),
    )
    x = mx.random.normal((8, 1, 4096), key=keys[3]).astype(mx.bfloat16)
    assert _cuda_few_row.self_check_qkv() is None
    joined = _cuda_few_row.qkv_product(x, ws)
    for y, w in zip(joined, ws, strict=True):
        assert mx.array_equal(y, few_row_product(x, w, "tile")).item()


@pytest.mark.parametrize("refusal", [None, "the q|k|v kernel did not run here: no mma"])
def test_the_load_joins_qkv_only_when_asked_and_checked(
    refusal: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the few-row product on and q|k|v asked for, a passed check joins every layer; a refusal says why."""
    model, report = _load_as_if_on_cuda(monkeypatch, None, qkv_refusal=refusal)
    joined = isinstance(model.layers[0].self_attn.q_proj, _cuda_few_row.QkvMember)
    if refusal is None:
        assert joined
        assert report.few_row_status.endswith(f"q|k|v joined in {len(model.layers)} layers")
    else:
        assert not joined
        assert report.few_row_status.endswith(refusal)
