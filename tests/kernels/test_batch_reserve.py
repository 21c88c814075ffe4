"""Room in a prefill's batch cache made once: the merge with room, the one growth, tokens unchanged."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from kernels import SamplingParams
from kernels.engine import RESERVE_ENV, BatchGeneration
from kernels.engine._reserve import merge_with_room, reserve
from tests.kernels.test_batch import ForwardSpy, _shared_prefix_plans, drive


def _kv(tokens: int, seed: int) -> KVCache:
    """A plain cache holding ``tokens`` random positions (2 heads, width 4)."""
    c = KVCache()
    k = mx.random.normal((1, 2, tokens, 4), key=mx.random.key(seed))
    c.update_and_fetch(k, k * 2)
    return c


def test_the_merge_with_room_holds_what_mlx_lms_merge_holds_and_the_room() -> None:
    """Rows of 5, 9 and 7 positions: the same left padding, offsets, index and visible keys and
    values as mlx-lm's merge, and capacity for 300 more tokens (rounded to the 256-token step)."""
    rows = [_kv(5, 1), _kv(9, 2), _kv(7, 3)]
    plain = BatchKVCache.merge(rows)  # type: ignore[no-untyped-call]
    roomy: Any = merge_with_room(rows, 300)
    assert roomy.left_padding.tolist() == plain.left_padding.tolist() == [4, 0, 2]
    assert roomy.offset.tolist() == plain.offset.tolist()
    assert roomy._idx == plain._idx == 9
    assert roomy.keys.shape[2] == 512
    for mine, theirs in ((roomy.keys, plain.keys), (roomy.values, plain.values)):
        assert mx.array_equal(mine[..., :9, :], theirs)


def test_no_room_or_nothing_cached_is_mlx_lms_merge() -> None:
    """room 0 and rows with nothing cached fall back to mlx-lm's merge (exactly as long as the longest)."""
    rows = [_kv(5, 1), _kv(9, 2)]
    assert merge_with_room(rows, 0).keys.shape[2] == 9
    empty: Any = merge_with_room([KVCache(), KVCache()], 100)
    assert empty.keys is None


def test_reserve_grows_once_and_the_next_forward_writes_in_place() -> None:
    """After reserve(300) a batch cache holds 300 more positions, its contents unchanged; an update
    of 200 then keeps the buffer's length (no growth); a cache with the room already is left alone."""
    cache: Any = BatchKVCache.merge([_kv(5, 1), _kv(9, 2)])  # type: ignore[no-untyped-call]
    before = [mx.array(cache.keys), mx.array(cache.values)]
    assert reserve([cache], 300) == 1
    assert cache.keys.shape[2] == 512
    for now, then in zip((cache.keys, cache.values), before, strict=True):
        assert mx.array_equal(now[..., :9, :], then)
    assert reserve([cache], 300) == 0
    k = mx.ones((2, 2, 200, 4))
    cache.update_and_fetch(k, k)
    assert cache.keys.shape[2] == 512
    assert cache._idx == 209


@pytest.mark.parametrize("room", [True, False])
def test_a_warm_group_joins_with_the_same_tokens_either_way(model: Any, tok: Any, room: bool) -> None:
    """Rows over a lent prefix with suffixes of 5, 9 and 14: their greedy tokens are those of the
    other setting; with room on, the group's merged buffers already hold the whole suffix."""
    params = SamplingParams(max_tokens=8)
    plans, _ = _shared_prefix_plans(model, tok, [5, 9, 14], params)
    other, _ = _shared_prefix_plans(model, tok, [5, 9, 14], params)
    seen: list[int] = []
    batch = BatchGeneration(ForwardSpy(model), tok, prefill_step_size=2048, reserve_room=room)
    merge = batch._merge

    def spy(caches: list[list[Any]], room: int = 0) -> list[Any]:
        merged = merge(caches, room)
        seen.append(merged[0].keys.shape[2])
        return merged

    batch._merge = spy  # type: ignore[method-assign]
    run = drive(batch, plans)
    ref = drive(BatchGeneration(model, tok, prefill_step_size=2048, reserve_room=not room), other)
    assert [run.ids(p.row_id) for p in plans] == [ref.ids(p.row_id) for p in other]
    # NOTE: 30 lent tokens; the aligned suffixes forward 13 more (the last token enters decode).
    assert seen[0] >= 30 + 13 if room else seen[0] == 30


def test_the_switch_is_read_from_the_environment(model: Any, tok: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTIER_BATCH_RESERVE=0 turns the room off; unset, it is on."""
    monkeypatch.setenv(RESERVE_ENV, "0")
    assert BatchGeneration(model, tok)._reserve is False
    monkeypatch.delenv(RESERVE_ENV)
    assert BatchGeneration(model, tok)._reserve is True
