"""Prefill attention of shapes new to cuDNN runs folded: the routing rule, the same attention, the same tokens."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kernels.engine import BatchGeneration, SamplingParams
from kernels.model import (
    FOLD_SCORES,
    PREFILL_FOLD_ENV,
    ShapeMemory,
    bind_masked_attention,
    folds_prefill,
    masked_dispatch,
    unbind_masked_attention,
)
from kernels.model import _masked_attention as impl
from kernels.model import _prefill_route as route
from tests.kernels.test_batch import Plan, _prompts, _serial, drive

SCALE = 0.125


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> ShapeMemory:
    """Prefill folding on, with a fresh shape memory for this thread (no shape seen by earlier tests)."""
    fresh = ShapeMemory(4)
    monkeypatch.setattr(route._local, "memory", fresh, raising=False)
    monkeypatch.setattr(impl, "_fold_prefill", True)
    monkeypatch.setattr(impl, "_cpu_softmax", None)
    return fresh


def test_a_new_small_shape_folds_once_then_builds_then_stays_warm() -> None:
    """First sighting folds, the second goes to cuDNN (built), later ones are warm; a large new shape builds at once."""
    m = ShapeMemory(8)
    assert m.fold(("a",), 100)
    assert not m.fold(("a",), 100)
    assert not m.fold(("a",), 100)
    assert (m.folded, m.built, m.warm) == (1, 1, 1)
    assert not m.fold(("big",), FOLD_SCORES + 1)
    assert not m.fold(("big",), FOLD_SCORES + 1)
    assert (m.folded, m.built, m.warm) == (1, 2, 2)


def test_a_built_shape_evicted_from_the_mirror_folds_again() -> None:
    """The mirror forgets built shapes past MLX's capacity (LRU), as MLX forgets their graphs."""
    m = ShapeMemory(2)
    for key in ("a", "b", "c"):
        m.fold((key,), FOLD_SCORES + 1)
    assert not m.fold(("c",), 1)  # still warm
    assert m.fold(("a",), 1)  # evicted: new again, small, folded


def _diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a - b)).astype(mx.float32).tolist())  # type: ignore[arg-type]


def _folding() -> bool:
    """The dispatch's prefill switch, read through a call (so the checker does not narrow it)."""
    return impl._fold_prefill


def _case(b: int, length: int, t: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    mx.random.seed(seed)
    q = mx.random.normal((b, 8, length, 32))
    kbuf = mx.random.normal((b, 2, t + 21, 32))
    vbuf = mx.random.normal((b, 2, t + 21, 32))
    return q, kbuf[..., :t, :], vbuf[..., :t, :]


def test_a_folded_causal_prefill_equals_mlx_bottom_right_causal(memory: ShapeMemory) -> None:
    """A causal prefill chunk over cached keys (T > L) folded gives mx.fast's bottom-right causal answer."""
    q, k, v = _case(1, 5, 23, seed=3)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal")
    got = masked_dispatch(q, k, v, object(), SCALE, "causal")
    assert memory.folded == 1
    assert _diff(got, want) < 1e-5
    # NOTE: the alignment matters: top-left causal is another answer.
    top_left = mx.arange(23)[None, :] <= mx.arange(5)[:, None]
    other = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=top_left)
    assert _diff(other, want) > 1e-2


def test_a_folded_batch_prefill_equals_mlx_under_its_array_mask(memory: ShapeMemory) -> None:
    """Several left-padded rows under the batch's boolean mask: folded equals mx.fast's answer."""
    b, length, t = 3, 4, 30
    q, k, v = _case(b, length, t, seed=4)
    pad = mx.array([0, 5, 11])[:, None, None, None]
    kpos = mx.arange(t)[None, None, None, :]
    qpos = (mx.arange(length) + (t - length))[None, None, :, None]
    mask = (kpos >= pad) & (kpos <= qpos)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
    got = masked_dispatch(q, k, v, object(), SCALE, mask)
    assert memory.folded == 1
    assert _diff(got, want) < 1e-5


class _QuantizedCache:
    bits = 4
    group_size = 64


def test_only_prefill_calls_with_a_causal_or_array_mask_fold(memory: ShapeMemory) -> None:
    """One position, no mask, another string mask, sinks or a quantized cache never fold; the switch off folds nothing."""
    q, k, _ = _case(1, 3, 10, seed=5)
    q1 = q[:, :, :1, :]
    arr = mx.ones((1, 1, 3, 10), dtype=mx.bool_)
    assert not folds_prefill(q1, k, object(), "causal", None)
    assert not folds_prefill(q, k, object(), None, None)
    assert not folds_prefill(q, k, object(), "window", None)
    assert not folds_prefill(q, k, object(), "causal", mx.zeros((8,)))
    assert not folds_prefill(q, k, _QuantizedCache(), "causal", None)
    assert memory.folded == memory.built == 0
    assert folds_prefill(q, k, object(), arr, None)
    assert memory.folded == 1


def test_the_key_follows_the_cache_buffer(memory: ShapeMemory) -> None:
    """The same slice shape over buffers of different lengths is two shapes (MLX keys the strides)."""

    class _Cache:
        def __init__(self, span: int) -> None:
            self.keys = mx.zeros((1, 2, span, 32))

    q, k, _ = _case(1, 3, 10, seed=6)
    assert folds_prefill(q, k, _Cache(256), "causal", None)
    assert not folds_prefill(q, k, _Cache(256), "causal", None)  # second sighting: built
    assert folds_prefill(q, k, _Cache(512), "causal", None)  # another buffer: new


def test_switched_off_every_prefill_call_is_mlx_lms(monkeypatch: pytest.MonkeyPatch, memory: ShapeMemory) -> None:
    """bind(fold_prefill=False) leaves prefill calls to mlx-lm's function."""
    monkeypatch.setattr(impl, "_fold_prefill", False)
    q, k, _ = _case(1, 3, 10, seed=7)
    assert not folds_prefill(q, k, object(), "causal", None)
    assert memory.folded == 0


def test_install_folds_prefill_only_when_its_switch_says_on(
    unbinding_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA, install() leaves prefill folding off unless KVTIER_CUDA_PREFILL_FOLD says on; unbind turns it off."""
    model = unbinding_model
    monkeypatch.setattr(impl, "on_cuda", lambda: True)
    monkeypatch.delenv(PREFILL_FOLD_ENV, raising=False)
    assert impl.install(model)
    assert not _folding()
    monkeypatch.setenv(PREFILL_FOLD_ENV, "on")
    assert impl.install(model)
    assert _folding()
    unbind_masked_attention(model)
    assert not _folding()


def test_folded_prefill_chunks_generate_the_serial_tokens(unbinding_model: Any, tok: Any, memory: ShapeMemory) -> None:
    """Rows joining with chunked prefills that fold (serial lane and batch lane) produce the unfolded serial run's greedy tokens."""
    model = unbinding_model
    prompts = _prompts(len(tok), 3, seed=91, lo=20, hi=60)
    params = SamplingParams(max_tokens=8)
    plain = [[o.token_id for o in _serial(model, tok, p, params, step=16)] for p in prompts]
    assert bind_masked_attention(model, fold_prefill=True)
    run = drive(
        BatchGeneration(model, tok, prefill_step_size=16),
        [Plan(str(i), p, params, join_at=i) for i, p in enumerate(prompts)],
    )
    serial = [[o.token_id for o in _serial(model, tok, p, params, step=16)] for p in prompts]
    assert memory.folded > 0, "no prefill call folded"
    assert serial == plain
    for i in range(len(prompts)):
        assert run.ids(str(i)) == plain[i]
