"""A row prefilling alone in the batch lane asks attention for the serial lane's causal mask, not an array."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kernels.engine import BatchGeneration, SamplingParams
from tests.kernels.test_batch import Plan, _prompts, _serial, drive

STEP = 16


class MaskSpy:
    """Delegates to a model; records (batch, tokens, mask kind) of every forward, the mask as its first layer's cache makes it."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.forwards: list[tuple[int, int, str]] = []

    def __call__(self, inputs: mx.array, **kw: Any) -> Any:
        mask = kw["cache"][0].make_mask(int(inputs.shape[1]))
        kind = mask if isinstance(mask, str) or mask is None else "array"
        self.forwards.append((int(inputs.shape[0]), int(inputs.shape[1]), str(kind)))
        return self._model(inputs, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_a_lone_row_prefills_with_the_causal_mask_and_decodes_with_the_batch_mask(
    model: Any, tok: Any
) -> None:
    """A row joining while another decodes prefills (batch of one, several chunks) under "causal"; decode steps keep the padded batch's array mask; tokens equal serial greedy."""
    early, late = _prompts(len(tok), 2, seed=41, lo=40, hi=60)
    params = SamplingParams(max_tokens=12)
    spy = MaskSpy(model)
    run = drive(
        BatchGeneration(spy, tok, prefill_step_size=STEP),
        [Plan("early", early[:5], SamplingParams(max_tokens=30)),
         Plan("late", late, params, join_at=3)],
    )
    chunks = [f for f in spy.forwards if f[1] > 1]
    # NOTE: "early"'s own prefill (4 tokens) and "late"'s full chunks, each a batch of one.
    assert [n for _, n, _ in chunks].count(STEP) == (len(late) - 1) // STEP >= 3, spy.forwards
    assert all(b == 1 and kind == "causal" for b, _, kind in chunks), chunks
    steps = [f for f in spy.forwards if f[1] == 1 and f[0] == 2]
    assert steps, spy.forwards
    assert all(kind == "array" for _, _, kind in steps), spy.forwards
    assert run.ids("late") == [o.token_id for o in _serial(model, tok, late, params, step=STEP)]
    assert run.ids("early") == [
        o.token_id for o in _serial(model, tok, early[:5], SamplingParams(max_tokens=30), step=STEP)
    ]


def test_rows_prefilling_together_keep_the_padded_array_mask(model: Any, tok: Any) -> None:
    """Rows that prefill as one padded group still get the array mask (their pads must stay masked) and equal serial greedy."""
    prompts = _prompts(len(tok), 3, seed=42, lo=10, hi=15)
    params = SamplingParams(max_tokens=6)
    spy = MaskSpy(model)
    run = drive(
        BatchGeneration(spy, tok, prefill_step_size=STEP),
        [Plan(str(i), p, params) for i, p in enumerate(prompts)],
    )
    group = [f for f in spy.forwards if f[0] == len(prompts) and f[1] > 1]
    assert group, spy.forwards
    assert all(kind == "array" for _, _, kind in group), spy.forwards
    for i, p in enumerate(prompts):
        assert run.ids(str(i)) == [o.token_id for o in _serial(model, tok, p, params, step=STEP)]


def test_the_causal_mask_comes_off_when_the_row_joins_the_decode_batch(model: Any, tok: Any) -> None:
    """Once a lone row enters the decode batch (rows padded, slots reused) its caches make the class's mask again."""
    prompt = _prompts(len(tok), 1, seed=43, lo=30, hi=30)[0]
    batch = BatchGeneration(model, tok, prefill_step_size=STEP)
    batch.join("only", prompt, SamplingParams(max_tokens=4))
    batch.step()
    decoding = batch._batch
    assert decoding is not None, "the row entered the decode batch"
    layers = [c for c in decoding.prompt_cache if "make_mask" in vars(c)]
    assert layers == [], f"{len(layers)} caches kept the lone row's mask"
    assert not isinstance(decoding.prompt_cache[0].make_mask(4), str)
    batch.close()
