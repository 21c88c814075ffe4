"""Short queries under an array mask as folded products: the same attention as MLX's, taken only where meant."""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import base

from kernels.engine import BatchGeneration, SamplingParams
from kernels.model import (
    MASKED_ATTENTION_ENV,
    bind_masked_attention,
    masked_attention,
    masked_dispatch,
    takes_masked_path,
    unbind_masked_attention,
)
from kernels.model import _masked_attention as impl
from tests.kernels.test_batch import Plan, _prompts, _serial, drive

SCALE = 0.125


def _case(b: int, h: int, hkv: int, length: int, t: int, seed: int) -> tuple[mx.array, ...]:
    """fp32 queries and keys/values sliced from a longer buffer (as a cache's are)."""
    mx.random.seed(seed)
    q = mx.random.normal((b, h, length, 64))
    kbuf = mx.random.normal((b, hkv, t + 37, 64))
    vbuf = mx.random.normal((b, hkv, t + 37, 64))
    return q, kbuf[..., :t, :], vbuf[..., :t, :]


def _pad_mask(b: int, length: int, t: int, pads: list[int]) -> mx.array:
    """(B, 1, L, T) boolean: each row's left padding hidden, causal over the last L keys."""
    pad = mx.array(pads)[:, None, None, None]
    kpos = mx.arange(t)[None, None, None, :]
    qpos = (mx.arange(length) + (t - length))[None, None, :, None]
    return (kpos >= pad) & (kpos <= qpos)


def _close(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a - b)).astype(mx.float32).tolist())  # type: ignore[arg-type]


@pytest.mark.parametrize(("h", "hkv"), [(8, 2), (4, 4), (9, 3)])
@pytest.mark.parametrize("length", [1, 3])
def test_the_folded_products_equal_mlx_under_a_padding_mask(h: int, hkv: int, length: int) -> None:
    """Grouped or not, one or several query positions: the folded attention equals mx.fast's under the batch's boolean mask."""
    b, t = 4, 50
    q, k, v = _case(b, h, hkv, length, t, seed=h * 10 + length)
    mask = _pad_mask(b, length, t, [0, 7, 19, 33])
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
    got = masked_attention(q, k, v, scale=SCALE, mask=mask)
    assert got.shape == want.shape == (b, h, length, 64)
    assert _close(got, want) < 1e-5
    # NOTE: the mask matters: without it the padded keys change the answer.
    unmasked = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)
    assert _close(unmasked, want) > 1e-2


def test_per_head_and_additive_masks_equal_mlx() -> None:
    """A mask per query head (B, H, L, T) and an additive float mask give mx.fast's answer too."""
    b, h, hkv, length, t = 2, 6, 2, 2, 40
    q, k, v = _case(b, h, hkv, length, t, seed=5)
    mx.random.seed(6)
    per_head = mx.random.uniform(shape=(b, h, length, t)) > 0.3
    per_head[..., -1] = True  # NOTE: no fully hidden row (its softmax would be undefined)
    for mask in (per_head, mx.where(per_head, 0.0, -1e9).astype(mx.float32)):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
        got = masked_attention(q, k, v, scale=SCALE, mask=mask)
        assert _close(got, want) < 1e-5


def test_query_heads_that_do_not_group_are_refused() -> None:
    """Query heads that are not a multiple of the key heads raise instead of reading the wrong heads."""
    q, k, v = _case(1, 5, 2, 1, 8, seed=1)
    with pytest.raises(ValueError, match="multiple"):
        masked_attention(q, k, v, scale=SCALE, mask=mx.ones((1, 1, 1, 8), dtype=mx.bool_))


class _QuantizedCache:
    bits = 4
    group_size = 64


def test_only_short_queries_under_an_array_mask_take_the_folded_path() -> None:
    """The dispatch diverts a short query under an array mask; string/absent masks, sinks, quantized caches and prefill chunks stay mlx-lm's."""
    q1 = mx.zeros((1, 4, 1, 64))
    arr = mx.ones((1, 1, 1, 8), dtype=mx.bool_)
    assert takes_masked_path(q1, object(), arr, None)
    assert takes_masked_path(mx.zeros((1, 4, impl.MAX_QUERY, 64)), object(), arr, None)
    assert not takes_masked_path(mx.zeros((1, 4, impl.MAX_QUERY + 1, 64)), object(), arr, None)
    assert not takes_masked_path(q1, object(), "causal", None)
    assert not takes_masked_path(q1, object(), None, None)
    assert not takes_masked_path(q1, object(), arr, mx.zeros((4,)))
    assert not takes_masked_path(q1, _QuantizedCache(), arr, None)


def test_the_dispatch_calls_mlx_lm_outside_the_folded_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call the dispatch does not divert reaches mlx-lm's function with every argument."""
    seen: list[tuple[Any, ...]] = []

    def spy(*args: Any) -> str:
        seen.append(args)
        return "mlx-lm"

    monkeypatch.setattr(impl, "_ORIGINAL", spy)
    monkeypatch.setattr(impl, "_cpu_softmax", None)
    q = mx.zeros((1, 4, 1, 64))
    assert masked_dispatch(q, "k", "v", "cache", SCALE, "causal", None) == "mlx-lm"
    assert seen == [(q, "k", "v", "cache", SCALE, "causal", None)]


def test_install_binds_on_cuda_only_and_honours_its_switch(
    unbinding_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """install() rebinds the model module's attention where CUDA is available, not elsewhere nor with the switch off; unbind gives it back."""
    import kernels.native

    model = unbinding_model
    module = sys.modules[type(model).__module__]
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
    monkeypatch.setattr(impl, "on_cuda", lambda: False)
    # NOTE: off CUDA, only the CPU's native softmax binds (its own test).
    monkeypatch.setattr(kernels.native, "softmax_op", lambda: None)
    assert not impl.install(model)
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
    monkeypatch.setattr(impl, "on_cuda", lambda: True)
    monkeypatch.setenv(MASKED_ATTENTION_ENV, "off")
    assert not impl.install(model)
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
    monkeypatch.delenv(MASKED_ATTENTION_ENV)
    assert impl.install(model)
    assert module.scaled_dot_product_attention is masked_dispatch
    unbind_masked_attention(model)
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_a_padded_batch_decodes_its_serial_tokens_through_the_folded_path(
    unbinding_model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of different lengths (left-padded, array-masked decode steps) bound to the folded path decode their serial greedy tokens, and the path ran."""
    model = unbinding_model
    prompts = _prompts(len(tok), 3, seed=77, lo=6, hi=40)
    params = SamplingParams(max_tokens=10)
    calls: list[int] = []
    inner = impl.masked_attention

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return inner(*args, **kw)

    monkeypatch.setattr(impl, "masked_attention", counted)
    assert bind_masked_attention(model)
    run = drive(
        BatchGeneration(model, tok, prefill_step_size=16),
        [Plan(str(i), p, params, join_at=i) for i, p in enumerate(prompts)],
    )
    assert calls, "no decode step took the folded path"
    unbind_masked_attention(model)
    for i, p in enumerate(prompts):
        assert run.ids(str(i)) == [o.token_id for o in _serial(model, tok, p, params, step=16)]
