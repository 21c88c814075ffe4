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
from tests.kernels.test_batch import ForwardSpy
from tests.kernels.test_generation import lively_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    """The ASCII tiny tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny fp32 Llama with varied greedy output."""
    return lively_llama(len(tok), seed=1)


def _serial(model: Any, tok: Any, prompt: list[int], max_tokens: int) -> list[int]:
    outputs = run_generation(
        Generation(model, tok, prompt, SamplingParams(max_tokens=max_tokens), prefill_step_size=16)
    )
    return [o.token_id for o in outputs]


def test_a_joining_row_is_forwarded_by_the_decode_step_it_joins(model: Any, tok: Any) -> None:
    """The step a row's prefill completes runs its prefill forward and one decode forward covering every row."""
    counting = ForwardSpy(model)
    batch = BatchGeneration(counting, tok, prefill_step_size=64)
    prompt_a = [5 + i % 40 for i in range(12)]
    prompt_b = [7 + i % 30 for i in range(20)]
    batch.join("a", prompt_a, SamplingParams(max_tokens=8))
    batch.step()
    batch.step()
    counting.shapes.clear()
    batch.join("b", prompt_b, SamplingParams(max_tokens=4))
    step = batch.step()
    assert step.joined == ("b",)
    # NOTE: b's prefill (all but its last prompt token, batch of one), then one
    # decode forward of both rows, one token each; no forward of b alone.
    assert counting.shapes == [(1, len(prompt_b) - 1), (2, 1)]
    assert [t.row_id for t in step.tokens] == ["a"]
    assert step.decode_rows == 1
    out: dict[str, list[int]] = {"a": [], "b": []}
    for t in step.tokens:
        out[t.row_id].append(t.output.token_id)
    first_b = batch.step()
    assert [t.row_id for t in first_b.tokens] == ["a", "b"]
    assert first_b.decode_rows == 2
    for t in first_b.tokens:
        out[t.row_id].append(t.output.token_id)
    while not batch.idle:
        for t in batch.step().tokens:
            out[t.row_id].append(t.output.token_id)
    assert out["b"] == _serial(model, tok, prompt_b, 4)


def test_the_padding_a_leaving_row_leaves_behind_is_trimmed_by_the_next_step(
    model: Any, tok: Any
) -> None:
    """After a long row leaves, the short row's shared left padding is dropped a step later; its tokens stay the serial ones."""
    batch = BatchGeneration(model, tok, prefill_step_size=64)
    long_prompt = [3 + i % 50 for i in range(40)]
    short_prompt = [9 + i % 20 for i in range(5)]
    batch.join("long", long_prompt, SamplingParams(max_tokens=2))
    batch.join("short", short_prompt, SamplingParams(max_tokens=12))
    out: list[int] = []
    pads: list[int] = []
    while not batch.idle:
        step = batch.step()
        out.extend(t.output.token_id for t in step.tokens if t.row_id == "short")
        gen = batch._batch
        if gen is not None and len(gen) == 1:
            layer: Any = gen.prompt_cache[0]
            assert type(layer) is BatchKVCache
            row_pads: Any = layer.left_padding.tolist()
            pads.append(int(row_pads[0]))
    # NOTE: the long prompt padded the short row by 35 when they prefilled
    # together; the step after the long row left must have trimmed it all.
    assert pads, "the short row decoded alone after the long one left"
    assert pads[-1] == 0
    assert out == _serial(model, tok, short_prompt, 12)
