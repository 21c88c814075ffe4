"""One-token steps through the few-row product: what is routed, prefill untouched, batch rows equal serial."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kernels.engine import BatchGeneration, SamplingParams
from kernels.model import FewRowHead, FewRowLinear, apply_few_row, fuse_projections
from tests.kernels.test_batch import Plan, _prompts, _serial, drive
from tests.kernels.test_generation import lively_llama, tiny_tokenizer

Op = Callable[[mx.array, mx.array], mx.array]



@pytest.fixture(scope="module")
def tok() -> Any:
    """The ASCII tiny tokenizer."""
    return tiny_tokenizer()


class CountingOp:
    """The product, counting its calls and the shapes it saw."""

    def __init__(self, op: Op) -> None:
        self.op = op
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, x: mx.array, w: mx.array) -> mx.array:
        self.shapes.append(tuple(x.shape))
        return self.op(x, w)


def test_every_projection_and_the_tied_head_are_routed(op: Op, tok: Any) -> None:
    """Unfused: 7 linears a layer plus the tied head; fused: each group, o, down, head."""
    model = lively_llama(len(tok), seed=1)
    layers = len(model.layers)
    assert apply_few_row(model, op) == 7 * layers + 1
    assert isinstance(model.layers[0].self_attn.q_proj, FewRowLinear)
    assert isinstance(model.model.embed_tokens, FewRowHead)
    fused = lively_llama(len(tok), seed=1)
    report = fuse_projections(fused)
    assert report.groups == 2 * layers
    assert apply_few_row(fused, op) == 4 * layers + 1
    assert apply_few_row(fused, op) == 0, "a second pass finds nothing left to route"


def test_one_token_steps_use_it_and_prefill_does_not(op: Op, tok: Any) -> None:
    """A prefill forward (many positions) never calls the product; a decode step calls it per projection."""
    model = lively_llama(len(tok), seed=1)
    spy = CountingOp(op)
    routed = apply_few_row(model, spy)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6]]), cache=cache))
    assert spy.shapes == []
    mx.eval(model(mx.array([[7]]), cache=cache))
    assert len(spy.shapes) == routed
    assert all(s[-2] == 1 for s in spy.shapes)


def test_logits_stay_within_rounding_of_blas(op: Op, tok: Any) -> None:
    """A decode step's logits with the product are MLX's within float32 rounding (not bitwise)."""
    plain = lively_llama(len(tok), seed=1)
    routed = lively_llama(len(tok), seed=1)
    apply_few_row(routed, op)
    prompt = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    out = []
    for m in (plain, routed):
        cache = make_prompt_cache(m)
        m(prompt, cache=cache)
        out.append(m(mx.array([[5]]), cache=cache)[0, -1])
    assert mx.allclose(out[0], out[1], rtol=1e-4, atol=1e-4).item()


def test_batch_rows_equal_their_serial_runs_token_for_token(op: Op, tok: Any) -> None:
    """8 prompts, staggered joins and leaves, fused model: every row's greedy tokens equal its serial run exactly."""
    model = lively_llama(len(tok), seed=1)
    fuse_projections(model)
    apply_few_row(model, op)
    prompts = _prompts(len(tok), 8, seed=11)
    rng = random.Random(2)
    plans = [
        Plan(str(i), p, SamplingParams(max_tokens=rng.randint(6, 24)), join_at=rng.randint(0, 12))
        for i, p in enumerate(prompts)
    ]
    # NOTE: first_token_first off keeps the joins as dense as this scenario
    # was written for (four rows or more decoding together).
    run = drive(BatchGeneration(model, tok, max_rows=6, prefill_step_size=16, first_token_first=False), plans)
    assert max(d for d, _, _ in run.steps) >= 4, "several rows must decode together"
    for p in plans:
        serial = [o.token_id for o in _serial(model, tok, p.prompt, p.params)]
        assert run.ids(p.row_id) == serial, f"row {p.row_id}"
