"""What rows joining and leaving the batch cost: no forward of their own, no per-layer read-back.

On the H200 (8B shape, 32 rows) mlx-lm's path spent 13.9 ms a join on a
separate forward of the joining rows' last prompt tokens and 12.8 ms a leave
on reading each layer's left padding back to trim it
(``tools/bench/join_cost.py``). These tests pin the cheaper path: a row
entering the decode batch is forwarded by the decode step it joins, and the
trim after a row leaves lands at the next step without changing any row's
tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
from mlx_lm.models.cache import BatchKVCache

from kernels import Generation, SamplingParams, run_generation
from kernels.engine import BatchGeneration
from kernels.engine._greedy import HOLE_STEPS, TRIM_MIN_TOKENS
from tests.kernels.test_batch import ForwardSpy


def _serial(model: Any, tok: Any, prompt: list[int], max_tokens: int) -> list[int]:
    outputs = run_generation(
        Generation(model, tok, prompt, SamplingParams(max_tokens=max_tokens), prefill_step_size=16)
    )
    return [o.token_id for o in outputs]


PROMPT_A = [5 + i % 40 for i in range(12)]
PROMPT_B = [7 + i % 30 for i in range(20)]


def _b_joins_beside_a(
    model: Any, tok: Any, *, read_first: bool
) -> tuple[ForwardSpy, BatchGeneration, Any, dict[str, list[int]]]:
    """Row a decoding for two steps, then b joining: the forward spy (cleared before b's step), the batch, b's join step and every token so far."""
    counting = ForwardSpy(model)
    batch = BatchGeneration(counting, tok, prefill_step_size=64, read_first=read_first)
    out: dict[str, list[int]] = {"a": [], "b": []}
    batch.join("a", PROMPT_A, SamplingParams(max_tokens=8))
    for _ in range(2):
        out["a"].extend(t.output.token_id for t in batch.step().tokens)
    counting.shapes.clear()
    batch.join("b", PROMPT_B, SamplingParams(max_tokens=4))
    step = batch.step()
    for t in step.tokens:
        out[t.row_id].append(t.output.token_id)
    return counting, batch, step, out


def test_a_joining_row_is_forwarded_by_the_decode_step_it_joins(model: Any, tok: Any) -> None:
    """mlx-lm's order: the step a row's prefill completes runs its prefill forward and one decode forward covering every row."""
    counting, batch, step, out = _b_joins_beside_a(model, tok, read_first=False)
    assert step.joined == ("b",)
    # NOTE: b's prefill (all but its last prompt token, batch of one), then one
    # decode forward of both rows, one token each; no forward of b alone.
    assert counting.shapes == [(1, len(PROMPT_B) - 1), (2, 1)]
    assert [t.row_id for t in step.tokens] == ["a"]
    assert step.decode_rows == 1
    first_b = batch.step()
    assert [t.row_id for t in first_b.tokens] == ["a", "b"]
    assert first_b.decode_rows == 2
    for t in first_b.tokens:
        out[t.row_id].append(t.output.token_id)
    _drain(batch, out)
    assert out["a"] == _serial(model, tok, PROMPT_A, 8)
    assert out["b"] == _serial(model, tok, PROMPT_B, 4)


def test_read_first_a_joining_row_shares_the_running_rows_forward_and_hands_out_its_first_token(model: Any, tok: Any) -> None:
    """Read first: the step a row's prefill completes forwards every row once (the running row's built forward taken back) and hands out both rows' tokens, the joining row's first among them."""
    counting, batch, step, out = _b_joins_beside_a(model, tok, read_first=True)
    assert step.joined == ("b",)
    # NOTE: b's prefill, the forward of both rows this step computes, and the
    # next step's forward of both, built and left unevaluated; none of a alone.
    assert counting.shapes == [(1, len(PROMPT_B) - 1), (2, 1), (2, 1)]
    assert [t.row_id for t in step.tokens] == ["a", "b"]
    assert [t.index for t in step.tokens if t.row_id == "b"] == [0]
    assert step.decode_rows == 1, "b's first token is its prefill's, not a decode"
    _drain(batch, out)
    assert out["a"] == _serial(model, tok, PROMPT_A, 8)
    assert out["b"] == _serial(model, tok, PROMPT_B, 4)


def _drain(batch: BatchGeneration, out: dict[str, list[int]]) -> None:
    while not batch.idle:
        for t in batch.step().tokens:
            out.setdefault(t.row_id, []).append(t.output.token_id)


def _step_until(batch: BatchGeneration, out: dict[str, list[int]], done: Any) -> None:
    for _ in range(200):
        if done():
            return
        for t in batch.step().tokens:
            out.setdefault(t.row_id, []).append(t.output.token_id)
    raise AssertionError("the condition never held")


def test_a_row_joining_after_another_left_takes_its_slot_without_copying_the_batch(
    model: Any, tok: Any
) -> None:
    """A leaving row's slot stays as a hole; the next row is written into it (same arrays, same rows); tokens stay serial."""
    batch = BatchGeneration(model, tok, max_rows=3, prefill_step_size=64)
    prompt_a, prompt_b = PROMPT_A, PROMPT_B
    prompt_c = [11 + i % 25 for i in range(15)]
    batch.join("a", prompt_a, SamplingParams(max_tokens=3))
    batch.join("b", prompt_b, SamplingParams(max_tokens=30))
    out: dict[str, list[int]] = {}
    _step_until(batch, out, lambda: "a" not in batch)
    gen: Any = batch._batch
    assert (len(gen), gen.holes) == (2, 1)
    slot = gen.uids.index(-1)
    layer: Any = gen.prompt_cache[0]
    keys_shape = layer.keys.shape
    batch.join("c", prompt_c, SamplingParams(max_tokens=10))
    _step_until(batch, out, lambda: batch.decoding == ("c", "b") or batch.decoding == ("b", "c"))
    gen = batch._batch
    assert (len(gen), gen.holes) == (2, 0)
    assert batch.decoding[slot] == "c"
    # NOTE: written into the slot in place: the layer keeps its rows and length.
    assert gen.prompt_cache[0].keys.shape == keys_shape
    _drain(batch, out)
    assert out["a"] == _serial(model, tok, prompt_a, 3)
    assert out["b"] == _serial(model, tok, prompt_b, 30)
    assert out["c"] == _serial(model, tok, prompt_c, 10)


def test_without_slot_reuse_a_leaving_row_is_filtered_out_at_once(model: Any, tok: Any) -> None:
    """reuse_slots=False (KVTIER_BATCH_SLOT_REUSE=0): mlx-lm's filter the step a row leaves, no hole; tokens stay serial."""
    batch = BatchGeneration(model, tok, prefill_step_size=64, reuse_slots=False)
    prompt_a, prompt_b = PROMPT_A, PROMPT_B
    batch.join("a", prompt_a, SamplingParams(max_tokens=2))
    batch.join("b", prompt_b, SamplingParams(max_tokens=10))
    out: dict[str, list[int]] = {}
    _step_until(batch, out, lambda: "a" not in batch)
    gen: Any = batch._batch
    assert (len(gen), gen.holes) == (1, 0)
    _drain(batch, out)
    assert out["b"] == _serial(model, tok, prompt_b, 10)


def test_a_hole_nobody_takes_is_compacted_after_hole_steps(model: Any, tok: Any) -> None:
    """With no row joining, the vacated slot is forwarded HOLE_STEPS steps, then the batch drops it."""
    batch = BatchGeneration(model, tok, prefill_step_size=64)
    prompt_a, prompt_b = PROMPT_A, PROMPT_B
    batch.join("a", prompt_a, SamplingParams(max_tokens=2))
    batch.join("b", prompt_b, SamplingParams(max_tokens=HOLE_STEPS + 12))
    out: dict[str, list[int]] = {}
    _step_until(batch, out, lambda: "a" not in batch)
    sizes: list[int] = []
    while not batch.idle:
        for t in batch.step().tokens:
            out.setdefault(t.row_id, []).append(t.output.token_id)
        if batch._batch is not None:
            sizes.append(len(batch._batch))
    assert sizes[: HOLE_STEPS - 1] == [2] * (HOLE_STEPS - 1)
    assert sizes[HOLE_STEPS:], "b decoded on after the hole was compacted"
    assert set(sizes[HOLE_STEPS:]) == {1}
    assert out["b"] == _serial(model, tok, prompt_b, HOLE_STEPS + 12)


def test_a_row_longer_than_the_batch_is_appended_not_put_in_a_hole(model: Any, tok: Any) -> None:
    """A joining row whose cache is longer than the batch's time axis extends the batch; its tokens stay serial."""
    batch = BatchGeneration(model, tok, max_rows=3, prefill_step_size=64)
    prompt_a = [5 + i % 40 for i in range(5)]
    prompt_b = [7 + i % 30 for i in range(6)]
    prompt_c = [11 + i % 25 for i in range(60)]
    batch.join("a", prompt_a, SamplingParams(max_tokens=2))
    batch.join("b", prompt_b, SamplingParams(max_tokens=20))
    out: dict[str, list[int]] = {}
    _step_until(batch, out, lambda: "a" not in batch)
    batch.join("c", prompt_c, SamplingParams(max_tokens=6))
    _step_until(batch, out, lambda: "c" in batch.decoding)
    gen: Any = batch._batch
    assert (len(gen), gen.holes) == (3, 1)
    _drain(batch, out)
    assert out["b"] == _serial(model, tok, prompt_b, 20)
    assert out["c"] == _serial(model, tok, prompt_c, 6)


@pytest.mark.parametrize(("long_len", "reuse", "trimmed"), [
    (40, True, False), (TRIM_MIN_TOKENS + 40, True, True), (40, False, True),
])
def test_shared_padding_a_leaving_row_leaves_is_trimmed_from_trim_min_tokens(
    model: Any, tok: Any, long_len: int, reuse: bool, trimmed: bool
) -> None:
    """After a long row leaves, the short row's padding is dropped a step later when it reaches TRIM_MIN_TOKENS (any padding without slot reuse), kept below; tokens stay serial."""
    batch = BatchGeneration(model, tok, prefill_step_size=256, reuse_slots=reuse)
    long_prompt = [3 + i % 50 for i in range(long_len)]
    short_prompt = [9 + i % 20 for i in range(5)]
    batch.join("long", long_prompt, SamplingParams(max_tokens=2))
    batch.join("short", short_prompt, SamplingParams(max_tokens=12))
    out: list[int] = []
    pads: list[int] = []
    while not batch.idle:
        step = batch.step()
        out.extend(t.output.token_id for t in step.tokens if t.row_id == "short")
        gen: Any = batch._batch
        if gen is not None and "long" not in batch:
            layer: Any = gen.prompt_cache[0]
            assert type(layer) is BatchKVCache
            row_pads: Any = layer.left_padding.tolist()
            pads.append(int(row_pads[gen.uids.index(batch._rows["short"].uid)]))
    # NOTE: the long prompt padded the short row by long_len - 5 when they
    # prefilled together.
    assert pads, "the short row decoded after the long one left"
    assert pads[-1] == (0 if trimmed else long_len - 5)
    assert out == _serial(model, tok, short_prompt, 12)
