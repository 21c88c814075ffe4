"""Prefill attention at bucketed shapes: the same attention as MLX's, at shapes from a small set, the same tokens."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kernels.engine import BatchGeneration, SamplingParams
from kernels.model import (
    ATTENTION_BUCKETS_ENV,
    bind_masked_attention,
    bucketed_attention,
    key_bucket,
    masked_dispatch,
    query_bucket,
    unbind_masked_attention,
)
from kernels.model import _masked_attention as impl
from tests.kernels.test_batch import Plan, _prompts, _serial, drive
from tests.kernels.test_prefill_route import _case

SCALE = 0.125


def _diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a - b)).astype(mx.float32).tolist())  # type: ignore[arg-type]


class _Recorder:
    """What ``attend`` saw: the padded shapes and mask; answers with mx.fast's attention."""

    def __init__(self) -> None:
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | str | None]] = []

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any) -> mx.array:
        shape = tuple(mask.shape) if isinstance(mask, mx.array) else mask
        self.shapes.append((tuple(q.shape), tuple(k.shape), shape))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def test_buckets_round_up_to_a_small_set() -> None:
    """Short queries round to 32, long ones to 128, keys to 256; a length on a bucket stays."""
    assert [query_bucket(n) for n in (2, 24, 32, 33, 256, 257, 530, 2048)] == [32, 32, 32, 64, 256, 384, 640, 2048]
    assert [key_bucket(n) for n in (1, 256, 257, 5124, 5376)] == [256, 256, 512, 5376, 5376]


@pytest.mark.parametrize(("length", "t"), [(5, 23), (24, 300), (2, 2), (40, 40)])
def test_a_causal_prefill_at_bucketed_shapes_equals_mlx(length: int, t: int) -> None:
    """A causal chunk over cached keys (bottom-right causal) padded to its buckets gives mx.fast's answer at its own length."""
    q, k, v = _case(1, length, t, seed=length + t)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal")
    seen = _Recorder()
    got = bucketed_attention(q, k, v, scale=SCALE, mask="causal", attend=seen)
    assert got.shape == want.shape
    assert _diff(got, want) < 1e-5
    assert seen.shapes == [((1, 8, query_bucket(length), 32), (1, 2, key_bucket(t), 32),
                            (1, 1, query_bucket(length), key_bucket(t)))]


def test_a_batch_prefill_under_its_padding_mask_equals_mlx() -> None:
    """Left-padded rows under the batch's boolean mask, and the same as an additive mask: bucketed equals mx.fast."""
    b, length, t = 3, 4, 30
    q, k, v = _case(b, length, t, seed=4)
    pad = mx.array([0, 5, 11])[:, None, None, None]
    kpos = mx.arange(t)[None, None, None, :]
    qpos = (mx.arange(length) + (t - length))[None, None, :, None]
    boolean = (kpos >= pad) & (kpos <= qpos)
    for mask in (boolean, mx.where(boolean, 0.0, -1e9).astype(mx.float32)):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
        got = bucketed_attention(q, k, v, scale=SCALE, mask=mask, attend=_Recorder())
        assert _diff(got, want) < 1e-5


def test_no_mask_means_every_real_key_and_none_of_the_padding() -> None:
    """A call without a mask sees every real key: bucketed equals mx.fast unmasked (the padded keys are hidden)."""
    q, k, v = _case(2, 3, 17, seed=8)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)
    got = bucketed_attention(q, k, v, scale=SCALE, mask=None, attend=_Recorder())
    assert _diff(got, want) < 1e-5


def test_the_padding_is_hidden_even_where_it_holds_large_values() -> None:
    """Keys past the real ones never count: a call whose attend sees huge padded keys still gives the real answer."""
    q, k, v = _case(1, 6, 40, seed=9)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal")

    def poisoned(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any) -> mx.array:
        # NOTE: what a reused buffer may hold past the offset: large finite values.
        kp = mx.concatenate([k[..., :40, :], mx.full(k[..., 40:, :].shape, 50.0)], axis=2)
        vp = mx.concatenate([v[..., :40, :], mx.full(v[..., 40:, :].shape, 1e4)], axis=2)
        return mx.fast.scaled_dot_product_attention(q, kp, vp, scale=scale, mask=mask)

    got = bucketed_attention(q, k, v, scale=SCALE, mask="causal", attend=poisoned)
    assert _diff(got, want) < 1e-4


def test_the_dispatch_buckets_prefill_calls_only_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """masked_dispatch pads a prefill call's shapes with buckets on, leaves them (and decode calls) alone with them off."""
    seen: list[tuple[int, int]] = []

    def original(q: mx.array, k: mx.array, v: mx.array, cache: Any, scale: float, mask: Any, sinks: Any = None) -> mx.array:
        seen.append((q.shape[2], k.shape[2]))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    monkeypatch.setattr(impl, "_ORIGINAL", original)
    monkeypatch.setattr(impl, "_fold_prefill", False)
    monkeypatch.setattr(impl, "_cpu_softmax", None)
    q, k, v = _case(1, 5, 23, seed=3)
    monkeypatch.setattr(impl, "_buckets", False)
    masked_dispatch(q, k, v, object(), SCALE, "causal")
    monkeypatch.setattr(impl, "_buckets", True)
    masked_dispatch(q, k, v, object(), SCALE, "causal")
    q1, k1, v1 = _case(1, 1, 23, seed=4)
    masked_dispatch(q1, k1, v1, object(), SCALE, None)
    assert seen == [(5, 23), (32, 256), (1, 23)]


def test_install_buckets_only_when_its_switch_says_on(unbinding_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, install() leaves buckets off unless KVTIER_CUDA_ATTENTION_BUCKETS says on; unbind turns them off."""
    model = unbinding_model
    monkeypatch.setattr(impl, "on_cuda", lambda: True)
    monkeypatch.delenv(ATTENTION_BUCKETS_ENV, raising=False)
    assert impl.install(model)
    assert not _bucketing()
    monkeypatch.setenv(ATTENTION_BUCKETS_ENV, "on")
    assert impl.install(model)
    assert _bucketing()
    unbind_masked_attention(model)
    assert not _bucketing()


def _bucketing() -> bool:
    """The dispatch's bucket switch, read through a call (so the checker does not narrow it)."""
    return impl._buckets


def test_bucketed_prefills_generate_the_serial_tokens(
    unbinding_model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows joining with chunked prefills at bucketed shapes (serial and batch lanes) produce the plain serial run's greedy tokens."""
    model = unbinding_model
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> mx.array:
        calls.append(1)
        return bucketed_attention(*args, **kwargs)

    monkeypatch.setattr(impl, "bucketed_attention", counted)
    prompts = _prompts(len(tok), 3, seed=93, lo=20, hi=60)
    params = SamplingParams(max_tokens=8)
    plain = [[o.token_id for o in _serial(model, tok, p, params, step=16)] for p in prompts]
    assert bind_masked_attention(model, buckets=True)
    run = drive(
        BatchGeneration(model, tok, prefill_step_size=16),
        [Plan(str(i), p, params, join_at=i) for i, p in enumerate(prompts)],
    )
    serial = [[o.token_id for o in _serial(model, tok, p, params, step=16)] for p in prompts]
    assert calls, "no prefill call was bucketed"
    assert serial == plain
    for i in range(len(prompts)):
        assert run.ids(str(i)) == plain[i]
