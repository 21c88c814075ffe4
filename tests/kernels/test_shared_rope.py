"""Shared RoPE tables (``kernels.model.SharedRope``): mlx's RoPE bits, one table per forward, never a wrong one."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx.nn.layers.positional_encoding import RoPE
from mlx_lm.models.cache import BatchKVCache

from kernels import SamplingParams
from kernels.engine import BatchGeneration
from kernels.model import SharedRope, declare_equal_offsets, share_rope_tables, transform_forward
from kernels.model._rope import _Memo
from tests.kernels.test_generation import lively_llama, tiny_tokenizer
from tests.tiny_models import tiny_llama


def _same(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_shared_rope_gives_mlx_rope_bits(dtype: Any) -> None:
    """Integer and per-row offsets (negative ones too), lengths 1-17, partial rotation: the same bits."""
    for dims, head_dim in ((16, 16), (8, 16)):
        rope: Any = RoPE(dims, base=10000.0)
        shared = SharedRope(rope, _Memo())
        for i, (rows, length, offset) in enumerate(
            [
                (1, 1, 0),
                (1, 1, 41),
                (1, 17, 3),
                (4, 1, mx.array([0, 5, -3, 90])),
                (2, 6, mx.array([7, 1])),
            ]
        ):
            x = mx.random.normal((rows, 3, length, head_dim), key=mx.random.key(i)).astype(dtype)
            assert _same(shared(x, offset=offset), rope(x, offset=offset))


def test_a_table_is_shared_only_for_the_same_or_declared_offsets() -> None:
    """Equal ints and one array object share; another array with other values gets its own, correct table."""
    rope: Any = RoPE(16, base=10000.0)
    memo = _Memo()
    a, b = SharedRope(rope, memo), SharedRope(rope, memo)
    x = mx.random.normal((2, 2, 1, 16), key=mx.random.key(0))
    a(x, offset=9)
    kept = memo.table
    b(x, offset=9)
    assert memo.table is kept
    first, other = mx.array([4, 6]), mx.array([30, 2])
    a(x, offset=first)
    kept = memo.table
    assert _same(b(x, offset=other), rope(x, offset=other))
    assert memo.table is not kept
    same_values = mx.array([30, 2])
    memo.equal = {id(other): other, id(same_values): same_values}
    kept = memo.table
    assert _same(a(x, offset=same_values), rope(x, offset=same_values))
    assert memo.table is kept


def test_share_rope_tables_keeps_the_model_bitwise() -> None:
    """A tiny Llama with shared tables and declared offsets decodes 1-6 rows with the plain model's logits and KV."""
    plain = tiny_llama(seed=2, dtype=mx.float32)
    shared = tiny_llama(seed=2, dtype=mx.float32)
    attn = shared.layers[0].self_attn
    assert (
        share_rope_tables(shared, dtype=mx.float32, head_dim=attn.head_dim, heads=attn.n_heads) == 2
    )
    assert type(shared.layers[1].self_attn.rope) is SharedRope
    for rows in range(1, 7):
        ca: list[Any] = [BatchKVCache([0] * rows) for _ in plain.layers]
        cb: list[Any] = [BatchKVCache([0] * rows) for _ in shared.layers]
        toks = mx.random.randint(0, 256, (rows, 9), key=mx.random.key(rows))
        plain(toks, cache=ca)
        shared(toks, cache=cb)
        for step in range(3):
            t = mx.random.randint(0, 256, (rows, 1), key=mx.random.key(50 + step))
            declare_equal_offsets(shared, [c.offset for c in cb])
            la, lb = plain(t, cache=ca), shared(t, cache=cb)
            assert _same(la, lb)
            assert all(_same(x.keys, y.keys) for x, y in zip(ca, cb, strict=True))


def test_traditional_rope_is_left_alone() -> None:
    """A traditional (interleaved) RoPE is not replaced."""
    model = tiny_llama(seed=0, dtype=mx.float32)
    for layer in model.layers:
        layer.self_attn.rope = RoPE(16, traditional=True, base=10000.0)
    assert share_rope_tables(model, dtype=mx.float32, head_dim=16, heads=4) == 0
    assert type(model.layers[0].self_attn.rope) is RoPE


def test_the_batch_lane_with_the_transformed_forward_keeps_tokens_and_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows joining at different steps: the plain model's tokens and exit KV, bit for bit; one RoPE table per decode step."""
    tok = tiny_tokenizer()
    plain = lively_llama(len(tok), seed=4)
    fast = lively_llama(len(tok), seed=4)
    report = transform_forward(fast)
    assert report.groups == 4
    assert report.rope_layers == 2

    real_rope = mx.fast.rope
    tables = [0]

    def counting_rope(*args: Any, **kwargs: Any) -> mx.array:
        tables[0] += 1
        return real_rope(*args, **kwargs)

    decode_only: list[int] = []

    def run(model: Any) -> dict[str, tuple[list[int], list[Any]]]:
        batch = BatchGeneration(model, tok, max_rows=6, prefill_step_size=16)
        prompts = [[(5 * i + 7 * j) % 80 + 10 for j in range(3 + 6 * i)] for i in range(6)]
        out: dict[str, tuple[list[int], list[Any]]] = {}
        tokens: dict[str, list[int]] = {str(i): [] for i in range(6)}
        for step in range(60):
            if step < 6:
                batch.join(str(step), prompts[step], SamplingParams(max_tokens=8 + 2 * step))
            if batch.idle:
                break
            before = tables[0]
            result = batch.step()
            if (
                model is fast
                and result.decode_rows
                and not result.joined
                and not result.prefill_tokens
            ):
                decode_only.append(tables[0] - before)
            for t in result.tokens:
                tokens[t.row_id].append(t.output.token_id)
            for e in result.exits:
                out[e.row_id] = (tokens[e.row_id], e.cache)
        return out

    want = run(plain)
    monkeypatch.setattr(mx.fast, "rope", counting_rope)
    got = run(fast)
    # NOTE: 2 layers x (queries, keys) would build 4 tables; declared offsets build 1.
    assert len(decode_only) >= 10
    assert set(decode_only) == {1}
    assert sorted(want) == sorted(got) == [str(i) for i in range(6)]
    for row, (tokens, cache) in want.items():
        assert got[row][0] == tokens
        for x, y in zip(cache, got[row][1], strict=True):
            assert _same(x.keys, y.keys)
            assert _same(x.values, y.values)
