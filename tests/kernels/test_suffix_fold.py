"""A short prefill over a cached prefix folded over the cache's buffer: which calls, the same attention, the same tokens."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from kernels.engine import BatchGeneration, SamplingParams
from kernels.model import (
    KEY_STEP,
    SUFFIX_FOLD_ENV,
    SUFFIX_MAX,
    bind_masked_attention,
    masked_dispatch,
    suffix_span,
    unbind_masked_attention,
)
from kernels.model import _masked_attention as impl
from tests.kernels.test_batch import Plan, _prompts, _serial, drive

SCALE = 0.125
HEADS, KV_HEADS, DIM = 8, 2, 32


def _diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a - b)).astype(mx.float32).tolist())  # type: ignore[arg-type]


def _filled(cache: Any, b: int, prefix: int, length: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    """``cache`` after a prefix of ``prefix`` positions, then the call's queries and its keys and values (as attention sees them)."""
    mx.random.seed(seed)
    cache.update_and_fetch(mx.random.normal((b, KV_HEADS, prefix, DIM)), mx.random.normal((b, KV_HEADS, prefix, DIM)))
    q = mx.random.normal((b, HEADS, length, DIM))
    k, v = cache.update_and_fetch(mx.random.normal((b, KV_HEADS, length, DIM)),
                                  mx.random.normal((b, KV_HEADS, length, DIM)))
    return q, k, v


class _Original:
    """mlx-lm's dispatcher stand-in: counts the calls it answers (with mx.fast's attention)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, cache: Any, scale: float, mask: Any,
                 sinks: Any = None) -> mx.array:
        self.calls += 1
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.fixture
def folding(monkeypatch: pytest.MonkeyPatch) -> _Original:
    """The dispatch with only the suffix fold on; mlx-lm's path replaced by a counter."""
    original = _Original()
    monkeypatch.setattr(impl, "_ORIGINAL", original)
    monkeypatch.setattr(impl, "_cpu_softmax", None)
    monkeypatch.setattr(impl, "_fold_prefill", False)
    monkeypatch.setattr(impl, "_buckets", False)
    monkeypatch.setattr(impl, "_suffix_fold", True)
    return original


def test_the_span_rounds_the_key_length_up_within_the_buffer_and_skips_what_it_cannot_fold() -> None:
    """A 24-position call over 5,100 cached keys folds over 5,376 (the buffer's 256-step length); a
    decode step, a call past SUFFIX_MAX, a cold prompt (no prefix), sinks, a quantized cache, a
    rotating (sliding-window) cache, a mask broadcast over the keys and a cache without buffers
    are left to the other paths."""
    cache = KVCache()
    q, k, _v = _filled(cache, 1, 5100, 24, seed=1)
    assert k.shape[2] == 5124
    assert suffix_span(q, k, cache, "causal", None) == 5376
    assert 5376 % KEY_STEP == 0
    assert suffix_span(q, k, cache, None, None) == 5376
    assert suffix_span(q[:, :, :1], k, cache, None, None) is None
    long_q = mx.zeros((1, HEADS, SUFFIX_MAX + 1, DIM))
    assert suffix_span(long_q, k, cache, "causal", None) is None
    cold = KVCache()
    cq, ck, _ = _filled(cold, 1, 0, 24, seed=2)
    assert suffix_span(cq, ck, cold, "causal", None) is None
    assert suffix_span(q, k, cache, "causal", mx.zeros((HEADS,))) is None

    class Quantized(KVCache):
        bits = 4

    quantized = Quantized()
    quantized.keys, quantized.values = cache.keys, cache.values
    assert suffix_span(q, k, quantized, "causal", None) is None
    rotating = RotatingKVCache(max_size=64)
    rq, rk, _ = _filled(rotating, 1, 100, 8, seed=3)
    assert suffix_span(rq, rk, rotating, "causal", None) is None
    assert suffix_span(q, k, cache, mx.ones((1, 1, 24, 1), dtype=mx.bool_), None) is None
    assert suffix_span(q, k, object(), "causal", None) is None


@pytest.mark.parametrize(("prefix", "length"), [(5100, 24), (40, 5), (250, 6), (300, 200)])
def test_a_causal_suffix_over_the_buffer_equals_mlx(folding: _Original, prefix: int, length: int) -> None:
    """A causal suffix over a cached prefix, folded over the buffer's span, gives mx.fast's
    bottom-right causal answer over the call's own keys (mlx-lm's path not called)."""
    cache = KVCache()
    q, k, v = _filled(cache, 1, prefix, length, seed=prefix + length)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal")
    got = masked_dispatch(q, k, v, cache, SCALE, "causal")
    assert got.shape == want.shape
    assert _diff(got, want) < 1e-4
    assert folding.calls == 0


def test_a_conversations_next_turns_fold_at_one_span_until_it_passes_a_step() -> None:
    """Turns appended to one cache (24, then 30 new positions over 5,100) fold over the same span,
    so the products see one key length; the turn that passes 5,376 moves to the next step."""
    cache = KVCache()
    q1, k1, _ = _filled(cache, 1, 5100, 24, seed=11)
    first = suffix_span(q1, k1, cache, "causal", None)
    mx.random.seed(12)
    q2 = mx.random.normal((1, HEADS, 30, DIM))
    k2, _ = cache.update_and_fetch(mx.random.normal((1, KV_HEADS, 30, DIM)), mx.random.normal((1, KV_HEADS, 30, DIM)))
    second = suffix_span(q2, k2, cache, "causal", None)
    q3 = mx.random.normal((1, HEADS, 230, DIM))
    k3, _ = cache.update_and_fetch(mx.random.normal((1, KV_HEADS, 230, DIM)), mx.random.normal((1, KV_HEADS, 230, DIM)))
    third = suffix_span(q3, k3, cache, "causal", None)
    assert (k1.shape[2], k2.shape[2], k3.shape[2]) == (5124, 5154, 5384)
    assert (first, second, third) == (5376, 5376, 5632)


def test_the_span_is_a_view_of_a_long_buffer_and_zeros_after_a_short_one() -> None:
    """span_of: a buffer at least span long gives its first span positions; a shorter one (mlx-lm's
    buffers grow by 256 from any length) its first t positions, then zeros up to span."""
    from kernels.model import span_of

    buf = mx.arange(2 * 600 * 3, dtype=mx.float32).reshape(1, 2, 600, 3)
    assert mx.array_equal(span_of(buf, 500, 512), buf[..., :512, :])
    short = buf[..., :530, :]
    got = span_of(short, 520, 768)
    assert got.shape == (1, 2, 768, 3)
    assert mx.array_equal(got[..., :520, :], buf[..., :520, :])
    assert not mx.any(got[..., 520:, :]).item()


def test_no_mask_sees_every_key_of_the_call_and_none_past_them(folding: _Original) -> None:
    """A suffix call without a mask (every query sees every key) over a buffer whose span runs past
    the keys equals mx.fast unmasked over the call's keys."""
    cache = KVCache()
    q, k, v = _filled(cache, 2, 130, 7, seed=8)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)
    assert _diff(masked_dispatch(q, k, v, cache, SCALE, None), want) < 1e-4
    assert folding.calls == 0


def test_what_the_buffer_holds_past_the_keys_never_counts(folding: _Original) -> None:
    """Large finite keys and values past the call's keys (what a reused buffer may hold) leave the answer unchanged."""
    cache = KVCache()
    q, k, v = _filled(cache, 1, 300, 12, seed=5)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal")
    t = k.shape[2]
    kbuf, vbuf = cache.keys, cache.values
    assert kbuf is not None
    assert vbuf is not None
    kbuf[..., t:, :] = 50.0
    vbuf[..., t:, :] = 1e4
    got = masked_dispatch(q, k, v, cache, SCALE, "causal")
    assert _diff(got, want) < 1e-4


def test_a_left_padded_batch_under_its_mask_equals_mlx(folding: _Original) -> None:
    """Rows of a batch cache (left padding) under the cache's own boolean mask, and the same as an
    additive mask: folded over the buffer equals mx.fast over the call's keys."""
    cache = BatchKVCache([0, 7, 19])
    mx.random.seed(6)
    cache.update_and_fetch(mx.random.normal((3, KV_HEADS, 60, DIM)), mx.random.normal((3, KV_HEADS, 60, DIM)))
    # NOTE: the model asks for the mask before its layers update the cache.
    boolean = cache.make_mask(9, return_array=True)
    q = mx.random.normal((3, HEADS, 9, DIM))
    k, v = cache.update_and_fetch(mx.random.normal((3, KV_HEADS, 9, DIM)), mx.random.normal((3, KV_HEADS, 9, DIM)))
    assert isinstance(boolean, mx.array)
    assert boolean.shape[-1] == k.shape[2]
    for mask in (boolean, mx.where(boolean, 0.0, -1e9).astype(mx.float32)):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
        got = masked_dispatch(q, k, v, cache, SCALE, mask)
        assert _diff(got, want) < 1e-4
    assert folding.calls == 0


def test_the_dispatch_folds_suffixes_only_when_switched_on(folding: _Original,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With the switch off a suffix call goes to mlx-lm's path; on, it does not; a decode step always does."""
    cache = KVCache()
    q, k, v = _filled(cache, 1, 100, 8, seed=7)
    monkeypatch.setattr(impl, "_suffix_fold", False)
    masked_dispatch(q, k, v, cache, SCALE, "causal")
    assert folding.calls == 1
    monkeypatch.setattr(impl, "_suffix_fold", True)
    masked_dispatch(q, k, v, cache, SCALE, "causal")
    assert folding.calls == 1
    masked_dispatch(q[:, :, :1], k, v, cache, SCALE, None)
    assert folding.calls == 2


def test_install_folds_suffixes_unless_its_switch_says_off(unbinding_model: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, install() turns the suffix fold on unless KVTIER_CUDA_SUFFIX_FOLD says off; unbind turns it off."""
    model = unbinding_model
    monkeypatch.setattr(impl, "on_cuda", lambda: True)
    monkeypatch.delenv(SUFFIX_FOLD_ENV, raising=False)
    assert impl.install(model)
    assert _folding()
    monkeypatch.setenv(SUFFIX_FOLD_ENV, "off")
    assert impl.install(model)
    assert not _folding()
    monkeypatch.delenv(SUFFIX_FOLD_ENV)
    assert impl.install(model)
    assert _folding()
    unbind_masked_attention(model)
    assert not _folding()


def _folding() -> bool:
    """The dispatch's suffix-fold switch, read through a call (so the checker does not narrow it)."""
    return impl._suffix_fold


def test_suffix_folded_prefills_generate_the_serial_tokens(
    unbinding_model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows joining with chunked prefills whose later chunks fold over the buffer (serial and batch
    lanes) produce the plain serial run's greedy tokens."""
    model = unbinding_model
    folded: list[int] = []
    real_span = suffix_span

    def counted(*args: Any) -> int | None:
        span = real_span(*args)
        if span is not None:
            folded.append(span)
        return span

    monkeypatch.setattr("kernels.model._masked_attention.suffix_span", counted)
    prompts = _prompts(len(tok), 3, seed=94, lo=20, hi=60)
    params = SamplingParams(max_tokens=8)
    plain = [[o.token_id for o in _serial(model, tok, p, params, step=16)] for p in prompts]
    assert bind_masked_attention(model, suffix_fold=True)
    run = drive(
        BatchGeneration(model, tok, prefill_step_size=16),
        [Plan(str(i), p, params, join_at=i) for i, p in enumerate(prompts)],
    )
    serial = [[o.token_id for o in _serial(model, tok, p, params, step=16)] for p in prompts]
    assert folded, "no prefill call was folded over its buffer"
    assert serial == plain
    for i in range(len(prompts)):
        assert run.ids(str(i)) == plain[i]
