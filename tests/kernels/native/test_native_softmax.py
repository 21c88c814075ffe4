"""The CPU's native softmax: MLX's answer within rounding, rows independent of leading hidden keys, attention and tokens through it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import base

import kernels.native
from kernels.engine import BatchGeneration, SamplingParams
from kernels.model import _masked_attention as impl
from kernels.model import bind_masked_attention, masked_dispatch, unbind_masked_attention
from kernels.native import (
    MaskedSoftmax,
    causal_softmax_op,
    masked_softmax_op,
    native_softmax_enabled,
    softmax_op,
    softmax_status,
)
from tests.kernels.native.conftest import unavailable
from tests.kernels.test_batch import Plan, _prompts, _serial, drive
from tests.kernels.test_prefill_route import _case

Softmax = Callable[[mx.array], mx.array]
Causal = Callable[[mx.array, int, int], mx.array]
SCALE = 0.125
HIDDEN = float(mx.finfo(mx.float32).min)


@pytest.fixture(scope="module")
def op() -> Softmax:
    """The native softmax as kvtier uses it (skips where it cannot run: no AVX2, no compiler)."""
    fn = softmax_op()
    if fn is None:
        unavailable("native softmax", softmax_status())
    assert fn is not None
    return fn


@pytest.fixture(scope="module")
def causal(op: Softmax) -> Causal:
    """The native causal rows (fails where the plain op runs and these do not: same extension)."""
    fn = causal_softmax_op()
    if fn is None:
        pytest.fail(f"the native causal softmax is unavailable: {softmax_status()}")
    return fn


@pytest.fixture(scope="module")
def masked(op: Softmax) -> MaskedSoftmax:
    """The native masked rows (fails where the plain op runs and these do not: same extension)."""
    fn = masked_softmax_op()
    if fn is None:
        pytest.fail(f"the native masked softmax is unavailable: {softmax_status()}")
    return fn


def _diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a - b)).tolist())  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 77, 3000])
def test_rows_equal_mlx_softmax_within_rounding(op: Softmax, n: int) -> None:
    """Rows of every length (a partial last vector included) sum to one and equal MLX's softmax within rounding."""
    x = mx.random.normal((4, 3, n), key=mx.random.key(n)) * 6.0
    got = op(x)
    want = mx.softmax(x, axis=-1, precise=True)
    assert got.shape == x.shape
    assert got.dtype == mx.float32
    # NOTE: MLX's own sum (one element after another) is the less exact of the two.
    assert mx.allclose(got, want, rtol=2e-5, atol=1e-7).item()
    assert _diff(mx.sum(got, axis=-1), mx.ones((4, 3))) < 1e-5


def test_hidden_keys_get_zero_and_leading_ones_change_no_bit(op: Softmax) -> None:
    """Keys hidden with the dtype's lowest value weigh exactly 0, and a row's weights keep their bits with any number of hidden keys before it."""
    x = mx.random.normal((2, 53), key=mx.random.key(3)) * 3.0
    alone = op(x)
    for pad in (1, 5, 8, 13):
        padded = op(mx.concatenate([mx.full((2, pad), HIDDEN), x], axis=1))
        assert mx.array_equal(padded[:, pad:], alone).item()
        assert not mx.any(padded[:, :pad]).item()
    # NOTE: hidden keys after the row (a causal mask's) weigh 0 too.
    tail = op(mx.concatenate([x, mx.full((2, 6), HIDDEN)], axis=1))
    assert not mx.any(tail[:, 53:]).item()
    assert _diff(tail[:, :53], alone) < 1e-7


@pytest.mark.parametrize(("period", "offset", "n"), [(1, 0, 9), (4, 0, 4), (5, 9, 14), (24, 300, 324), (3, 2, 40)])
def test_causal_rows_equal_the_masked_softmax_bit_for_bit(
    op: Softmax, causal: Causal, period: int, offset: int, n: int
) -> None:
    """Row r seeing its first offset + r % period + 1 elements gives the plain op's bits on the row with the rest hidden, and zeros past them."""
    x = mx.random.normal((2, 3 * period, n), key=mx.random.key(period + n)) * 5.0
    query = mx.arange(3 * period)[:, None] % period
    seen = mx.arange(n)[None, :] <= query + offset
    masked = op(mx.where(seen, x, HIDDEN))
    got = causal(x, period, offset)
    assert mx.array_equal(got, masked).item()
    assert mx.allclose(got, mx.softmax(mx.where(seen, x, HIDDEN), axis=-1, precise=True), rtol=2e-5, atol=1e-7).item()


@pytest.mark.parametrize(("b", "mb", "length", "ml"), [(3, 3, 16, 16), (3, 1, 16, 16), (4, 4, 1, 1), (2, 2, 9, 1)],
                         ids=["per-row prefill", "one mask", "decode", "one position per row"])
def test_masked_rows_equal_where_then_the_plain_rows_bit_for_bit(
    op: Softmax, masked: MaskedSoftmax, b: int, mb: int, length: int, ml: int
) -> None:
    """A boolean mask (left padding and causal, per batch row or one for all, per position or
    one per row) applied inside the softmax gives the bits of where(mask, x, lowest) then the
    plain rows, over folded rows (3 key heads x 2 repeats x L positions per batch row)."""
    heads, t = 6, 1100
    x = mx.random.normal((b, heads * length, t), key=mx.random.key(b * 7 + length)) * 5.0
    pad = (mx.arange(mb) * 37)[:, None, None]
    kpos = mx.arange(t)[None, None, :]
    qpos = (mx.arange(ml) + (t - ml))[None, :, None]
    mask = (kpos >= pad) & (kpos <= qpos)
    # NOTE: folded row (i, head, p) takes mask row (i or 0, p or 0): broadcast, as MLX would.
    rows = mx.broadcast_to(mask[:, None], (b, heads, length, t)).reshape(b, heads * length, t)
    want = op(mx.where(rows, x, HIDDEN))
    got = masked(x, mask, heads * length, mb, ml)
    assert mx.array_equal(got, want).item()


def test_masked_rows_refuse_a_mask_that_does_not_cover_the_rows(masked: MaskedSoftmax) -> None:
    """A mask of other rows or length is refused, never read out of bounds."""
    x = mx.zeros((2, 8, 10))
    with pytest.raises(ValueError, match="mask"):
        masked(x, mx.ones((3, 10), dtype=mx.bool_), 8, 2, 2)
    with pytest.raises(ValueError, match="mask"):
        masked(x, mx.ones((4, 9), dtype=mx.bool_), 8, 2, 2)
    with pytest.raises(ValueError, match="bool"):
        masked(x, mx.ones((4, 10)), 8, 2, 2)


def test_inside_a_lazy_graph_and_on_views(op: Softmax) -> None:
    """The op takes a lazy, strided input (made contiguous) and feeds later ops."""
    x = mx.random.normal((6, 40), key=mx.random.key(9))
    view = (x * 2.0).T[:, ::2]
    got = op(view) @ mx.ones((3,))
    want = mx.softmax(view, axis=-1, precise=True) @ mx.ones((3,))
    assert _diff(got, want) < 2e-6


def test_a_large_score_anywhere_is_the_rows_maximum(op: Softmax) -> None:
    """A score of 200 over scores near 0 at any position of a 21-element row (every lane of the
    vector maximum, the scalar tail included) takes the whole weight: the maximum subtracted is
    that score's (a smaller one would overflow the exp)."""
    for at in range(21):
        x = mx.where(mx.arange(21) == at, 200.0, mx.random.normal((21,), key=mx.random.key(at)))
        got = op(x[None])
        assert got[0, at].item() == 1.0
        assert mx.isfinite(got).all().item()


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_rows_split_across_threads_keep_their_bits(op: Softmax, threads: int) -> None:
    """A prefill chunk's rows split across 2-4 threads give one thread's bits, plain and causal."""
    from kernels.native import load_extension

    ext = load_extension()
    x = mx.random.normal((9, 64, 1200), key=mx.random.key(threads)) * 5.0
    assert mx.array_equal(ext.softmax(x, threads), ext.softmax(x, 1)).item()
    assert mx.array_equal(ext.softmax_causal(x, 64, 1100, threads),
                          ext.softmax_causal(x, 64, 1100, 1)).item()
    with pytest.raises(ValueError, match="threads"):
        ext.softmax(x, 0)


def test_a_nan_score_is_not_hidden(op: Softmax) -> None:
    """A NaN among a row's scores makes that row NaN, as MLX's softmax does; other rows stay finite."""
    x = mx.random.normal((3, 20), key=mx.random.key(4))
    x = mx.where((mx.arange(3)[:, None] == 1) & (mx.arange(20)[None, :] == 7), mx.array(float("nan")), x)
    got = op(x)
    assert mx.all(mx.isnan(got[1])).item()
    assert not mx.any(mx.isnan(got[0])).item()
    assert not mx.any(mx.isnan(got[2])).item()


def test_other_dtypes_are_refused(op: Softmax) -> None:
    """Only float32: half precision is refused, not silently widened."""
    with pytest.raises(ValueError, match="float32"):
        op(mx.zeros((2, 4), dtype=mx.float16))


def test_the_switch() -> None:
    """KVTIER_NATIVE_SOFTMAX=0 (or off) switches it off; unset or 1 leaves it on."""
    assert native_softmax_enabled({})
    assert native_softmax_enabled({"KVTIER_NATIVE_SOFTMAX": "1"})
    assert not native_softmax_enabled({"KVTIER_NATIVE_SOFTMAX": "0"})
    assert not native_softmax_enabled({"KVTIER_NATIVE_SOFTMAX": "off"})


@pytest.mark.parametrize("with_rows", [False, True], ids=["mask-then-plain", "causal-and-masked-rows"])
def test_attention_through_it_equals_mlx(
    op: Softmax, causal: Causal, masked: MaskedSoftmax, monkeypatch: pytest.MonkeyPatch, with_rows: bool
) -> None:
    """With the CPU path bound (causal and masked rows, or masks applied before the plain rows), causal prefill chunks, a decode step, a padded batch's mask and no mask equal mx.fast's attention."""
    monkeypatch.setattr(impl, "_cpu_softmax", op)
    monkeypatch.setattr(impl, "_cpu_causal", causal if with_rows else None)
    monkeypatch.setattr(impl, "_cpu_masked", masked if with_rows else None)
    q, k, v = _case(1, 24, 300, seed=1)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal")
    assert _diff(masked_dispatch(q, k, v, object(), SCALE, "causal"), want) < 1e-5
    q1, k1, v1 = _case(2, 1, 70, seed=2)
    want = mx.fast.scaled_dot_product_attention(q1, k1, v1, scale=SCALE)
    assert _diff(masked_dispatch(q1, k1, v1, object(), SCALE, "causal"), want) < 1e-5
    assert _diff(masked_dispatch(q1, k1, v1, object(), SCALE, None), want) < 1e-5
    b, length, t = 3, 4, 30
    q, k, v = _case(b, length, t, seed=4)
    pad = mx.array([0, 5, 11])[:, None, None, None]
    kpos = mx.arange(t)[None, None, None, :]
    qpos = (mx.arange(length) + (t - length))[None, None, :, None]
    mask = (kpos >= pad) & (kpos <= qpos)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
    assert _diff(masked_dispatch(q, k, v, object(), SCALE, mask), want) < 1e-5


def test_sinks_quantized_caches_and_half_precision_stay_mlx_lms(op: Softmax, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path takes float32 calls only, without sinks and outside quantized caches."""
    monkeypatch.setattr(impl, "_cpu_softmax", op)
    q = mx.zeros((1, 4, 3, 64))

    class Quantized:
        bits = 4

    assert impl.takes_cpu_path(q, object(), "causal", None)
    assert impl.takes_cpu_path(q, object(), None, None)
    assert not impl.takes_cpu_path(q, object(), "causal", mx.zeros((4,)))
    assert not impl.takes_cpu_path(q, Quantized(), "causal", None)
    assert not impl.takes_cpu_path(q.astype(mx.float16), object(), "causal", None)
    monkeypatch.setattr(impl, "_cpu_softmax", None)
    assert not impl.takes_cpu_path(q, object(), "causal", None)


def test_install_binds_it_on_the_cpu(unbinding_model: Any, op: Softmax, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off CUDA, install() binds the dispatch with the native softmax where it runs, and not where it does not."""
    model = unbinding_model
    module = sys.modules[type(model).__module__]
    monkeypatch.setattr(impl, "on_cuda", lambda: False)
    monkeypatch.setattr(kernels.native, "softmax_op", lambda: None)
    assert not impl.install(model)
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
    monkeypatch.setattr(kernels.native, "softmax_op", lambda: op)
    assert impl.install(model)
    assert module.scaled_dot_product_attention is masked_dispatch
    assert impl._cpu_softmax is op
    bound = impl._cpu_masked
    assert bound is not None
    unbind_masked_attention(model)
    assert impl._cpu_masked is None
    assert impl._cpu_softmax is None


@pytest.mark.parametrize("with_masked", [False, True], ids=["where-then-rows", "masked-rows"])
def test_padded_batch_rows_generate_their_serial_tokens_through_it(
    unbinding_model: Any, tok: Any, op: Softmax, causal: Causal, masked: MaskedSoftmax,
    monkeypatch: pytest.MonkeyPatch, with_masked: bool,
) -> None:
    """Rows of different lengths (left-padded, masked: by ``where`` before the plain rows, or in
    the masked rows) decode exactly their serial runs' greedy tokens with the native softmax, and it ran."""
    model = unbinding_model
    calls: list[int] = []
    causal_calls: list[int] = []
    masked_calls: list[int] = []

    def counted(x: mx.array) -> mx.array:
        calls.append(1)
        return op(x)

    def counted_causal(x: mx.array, period: int, offset: int) -> mx.array:
        causal_calls.append(1)
        return causal(x, period, offset)

    def counted_masked(x: mx.array, mask: mx.array, per_batch: int, mask_batches: int,
                       period: int) -> mx.array:
        masked_calls.append(1)
        return masked(x, mask, per_batch, mask_batches, period)

    prompts = _prompts(len(tok), 4, seed=95, lo=6, hi=60)
    params = SamplingParams(max_tokens=12)
    # NOTE: the serial lane's prefill takes the causal rows, the batch lane's
    # padded rows the plain op under their mask: the tokens must agree.
    assert bind_masked_attention(model, cpu_softmax=counted, cpu_causal=counted_causal,
                                 cpu_masked=counted_masked if with_masked else None)
    run = drive(
        BatchGeneration(model, tok, prefill_step_size=16),
        [Plan(str(i), p, params, join_at=i) for i, p in enumerate(prompts)],
    )
    serial = [[o.token_id for o in _serial(model, tok, p, params, step=16)] for p in prompts]
    assert calls, "no attention call took the native softmax"
    assert causal_calls, "no causal prefill took the causal rows"
    assert bool(masked_calls) == with_masked, "the masked rows ran where not bound, or not where bound"
    for i in range(len(prompts)):
        assert run.ids(str(i)) == serial[i]
