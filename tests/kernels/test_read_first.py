"""Read first: where async_eval blocks (the CPU) a decode step computes its own tokens before it builds the next forward, and every token stays the same."""

from __future__ import annotations

import io
from typing import Any

import mlx.core as mx
import pytest

import kernels._device as device
from kernels import READ_FIRST_ENV, SamplingParams, cache_arrays, read_first_setting
from kernels.engine import BatchGeneration, Generation, run_generation
from tests.kernels.test_batch import Plan, _prompts, assert_same_rows, drive


def _plans(tok: Any) -> list[Plan]:
    """Five rows joining at staggered steps, greedy, seeded sampling and logprobs, leaving at different lengths."""
    prompts = _prompts(len(tok), 5, seed=71, lo=4, hi=30)
    params = [
        SamplingParams(max_tokens=9),
        SamplingParams(max_tokens=5, temperature=0.8, seed=3),
        SamplingParams(max_tokens=12, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=7, temperature=1.1, top_p=0.9, seed=5),
    ]
    return [Plan(str(i), p, q, join_at=2 * i) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]


def _record_decode_steps(model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch, *, read_first: bool) -> list[list[str]]:
    """The async_eval calls and one-position forwards of every step that only decoded, in order."""
    events: list[str] = []
    real_eval = mx.async_eval
    real_call = type(model).__call__

    def spy_eval(*args: Any) -> None:
        events.append("async_eval")
        real_eval(*args)

    def spy_call(self: Any, inputs: mx.array, *args: Any, **kw: Any) -> Any:
        if inputs.shape[-1] == 1:
            events.append("forward")
        return real_call(self, inputs, *args, **kw)

    monkeypatch.setattr(mx, "async_eval", spy_eval)
    monkeypatch.setattr(type(model), "__call__", spy_call)
    batch = BatchGeneration(model, tok, prefill_step_size=64, read_first=read_first)
    batch.join("a", _prompts(len(tok), 1, seed=72, lo=12, hi=12)[0], SamplingParams(max_tokens=8))
    steps: list[list[str]] = []
    while not batch.idle:
        events.clear()
        result = batch.step()
        if result.prefill_tokens == 0 and not result.joined and not result.exits:
            steps.append(list(events))
    batch.close()
    return steps


def test_a_read_first_step_computes_its_tokens_before_it_builds_the_next_forward(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read first: a decode step starts its own tokens (async_eval) and then builds the next forward, which it leaves unevaluated; mlx-lm's order queues the next forward after building it."""
    first = _record_decode_steps(model, tok, monkeypatch, read_first=True)
    mlx_order = _record_decode_steps(model, tok, monkeypatch, read_first=False)
    assert len(first) >= 5
    # NOTE: read first hands out the first token in the step the row enters,
    # so one fewer step only decodes.
    assert len(mlx_order) == len(first) + 1
    assert all(step == ["async_eval", "forward"] for step in first), first
    assert all(step == ["forward", "async_eval"] for step in mlx_order), mlx_order


LOGPROB_ROUNDING = 1e-4
"""How far a logprob or a cached value may move with one forward's rows (float32 rounding, not a token)."""


def test_batch_rows_emit_the_same_tokens_either_way(model: Any, tok: Any) -> None:
    """Staggered greedy, seeded and logprob rows: every row's tokens and finish reasons are the same with and without read first, logprobs within rounding.

    NOTE: not bit for bit: read first, a joining row shares the forward the
    running rows' step built (retract), where mlx-lm's order computes that
    forward without it; more rows (and padding) in one forward round the
    running rows' attention sums differently.
    """
    runs = [
        drive(BatchGeneration(model, tok, prefill_step_size=8, read_first=flag), _plans(tok))
        for flag in (True, False)
    ]
    first, mlx_order = runs
    assert_same_rows(first, mlx_order, 5, rounding=LOGPROB_ROUNDING)


def test_exit_caches_hold_the_same_keys_either_way(model: Any, tok: Any) -> None:
    """A leaving row's cache holds the same keys and values (within rounding) with and without read first, read first's ending before the answer's last token (mlx-lm's order waits for its forward)."""
    caches = []
    for flag in (True, False):
        run = drive(BatchGeneration(model, tok, prefill_step_size=8, read_first=flag), _plans(tok))
        caches.append(run.exits["2"])
    first, mlx_order = caches
    assert first.cache_tokens == mlx_order.cache_tokens[:-1]
    n = len(first.cache_tokens)
    arrays = [cache_arrays(c.cache) for c in (first, mlx_order)]
    assert len(arrays[0]) == len(arrays[1]) > 0
    assert all(a.shape[2] == n == b.shape[2] - 1 for a, b in zip(*arrays, strict=True))
    assert all(
        mx.allclose(a, b[:, :, :n], rtol=0, atol=LOGPROB_ROUNDING).item() for a, b in zip(*arrays, strict=True)
    )


def _short_and_long(model: Any, tok: Any, seed: int, *, read_first: bool, short: int, long: int) -> BatchGeneration:
    """A batch with rows "short" and "long" (``short`` / ``long`` new tokens) joined, nothing stepped."""
    prompts = _prompts(len(tok), 2, seed=seed, lo=5, hi=11)
    batch = BatchGeneration(model, tok, prefill_step_size=64, read_first=read_first)
    batch.join("short", prompts[0], SamplingParams(max_tokens=short))
    batch.join("long", prompts[1], SamplingParams(max_tokens=long))
    return batch


def test_a_row_leaves_without_computing_the_forward_built_for_its_last_token(model: Any, tok: Any) -> None:
    """Read first: the step a row leaves in hands back its cache without evaluating the next forward (the running row's layers still hold it to run, the leaving row's cache is computed); mlx-lm's order evaluates that forward for the leaving row's cache."""
    prompt_len = len(_prompts(len(tok), 2, seed=79, lo=5, hi=11)[0])
    for flag in (True, False):
        batch = _short_and_long(model, tok, 79, read_first=flag, short=4, long=12)
        while not (result := batch.step()).exits:
            pass
        (gone,) = result.exits
        assert gone.row_id == "short"
        mx.synchronize()
        inner = batch._batch
        assert inner is not None
        layers: list[Any] = list(inner.prompt_cache)
        assert all(_operations(a) == 0 for a in cache_arrays(gone.cache))
        pending = [_operations(c.keys) > 0 for c in layers]
        assert all(pending) if flag else not any(pending), flag
        assert len(gone.cache_tokens) == prompt_len + 4 - flag
        batch.close()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=0.9, seed=11)])
def test_serial_lane_tokens_are_the_same_either_way(
    model: Any, tok: Any, params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serial lane with and without read first: the same tokens and the same cache tokens."""
    prompt = _prompts(len(tok), 1, seed=73, lo=20, hi=20)[0]
    outs = []
    for value in ("on", "off"):
        monkeypatch.setenv(READ_FIRST_ENV, value)
        gen = Generation(model, tok, prompt, params, prefill_step_size=8)
        outs.append(([o.token_id for o in run_generation(gen)], gen.cache_tokens))
    assert outs[0] == outs[1]


def test_the_setting_is_on_where_async_eval_blocks_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU read first is on unless KVTIER_READ_FIRST says off; where async_eval does not block it is off."""
    assert device.async_eval_blocks()  # NOTE: these tests run on MLX's CPU device.
    assert read_first_setting({})
    assert not read_first_setting({READ_FIRST_ENV: "off"})
    monkeypatch.setattr(device, "async_eval_blocks", lambda: False)
    assert not read_first_setting({})


def _first_token_steps(batch: BatchGeneration, plans: list[Plan]) -> dict[str, tuple[int, int]]:
    """Per row: the step it entered the decode batch and the step that handed out its first token."""
    waiting = sorted(plans, key=lambda p: p.join_at)
    entered: dict[str, int] = {}
    first: dict[str, int] = {}
    step = 0
    while waiting or not batch.idle:
        assert step < 500
        while waiting and waiting[0].join_at <= step:
            p = waiting.pop(0)
            batch.join(p.row_id, p.prompt, p.params)
        result = batch.step()
        for row_id in result.joined:
            entered[row_id] = step
        for t in result.tokens:
            if t.index == 0:
                first[t.row_id] = step
        step += 1
    batch.close()
    return {row_id: (entered[row_id], first[row_id]) for row_id in entered}


def test_a_row_entering_beside_running_rows_hands_out_its_first_token_in_that_step(model: Any, tok: Any) -> None:
    """Read first, a row entering while another decodes gets its first token in the step it enters (the running row's built forward taken back); mlx-lm's order hands it out a step later."""
    prompts = _prompts(len(tok), 3, seed=74, lo=6, hi=14)
    plans = [Plan(str(i), p, SamplingParams(max_tokens=10), join_at=3 * i) for i, p in enumerate(prompts)]
    first = _first_token_steps(BatchGeneration(model, tok, prefill_step_size=64, read_first=True), plans)
    later = _first_token_steps(BatchGeneration(model, tok, prefill_step_size=64, read_first=False), plans)
    assert all(entered == handed for entered, handed in first.values()), first
    assert all(handed == entered + 1 for entered, handed in later.values()), later


def test_the_turn_after_a_read_first_join_prefills_the_next_row(model: Any, tok: Any) -> None:
    """Read first no turn owes a first token: the step after a row entered forwards the next row's prompt."""
    (short,) = _prompts(len(tok), 1, seed=31, lo=6, hi=6)
    (long,) = _prompts(len(tok), 1, seed=32, lo=41, hi=41)
    plans = [Plan("a", short, SamplingParams(max_tokens=6)), Plan("b", long, SamplingParams(max_tokens=6), join_at=1)]
    run = drive(BatchGeneration(model, tok, prefill_step_size=8, first_token_first=True, read_first=True), plans)
    assert run.entered[0] == 1
    assert run.steps[0][1] == 1, "a's first token did not come in the step it entered"
    assert run.steps[1][2] == 8, "the turn after a's entry did not prefill b"


def _retracting_run(model: Any, tok: Any, plans: list[Plan], *, retract: bool) -> tuple[dict[str, list[Any]], dict[str, Any], int]:
    """Rows joining together, stepped to the end; with ``retract`` every decode-only step's built forward is taken back first."""
    batch = BatchGeneration(model, tok, prefill_step_size=64, read_first=True)
    for p in plans:
        batch.join(p.row_id, p.prompt, p.params)
    outputs: dict[str, list[Any]] = {p.row_id: [] for p in plans}
    exits: dict[str, Any] = {}
    taken = 0
    while not batch.idle:
        # NOTE: the lane's decode batch, reached directly: nothing joins here,
        # so only this test's retract makes the step forward twice.
        inner = batch._batch
        if retract and inner is not None:
            taken += inner.retract()
        result = batch.step()
        for t in result.tokens:
            outputs[t.row_id].append(t.output)
        for e in result.exits:
            exits[e.row_id] = e
    batch.close()
    return outputs, exits, taken


def test_a_retracted_step_computes_exactly_what_the_built_forward_would(model: Any, tok: Any) -> None:
    """Taking back every built forward and forwarding again gives bit for bit the same tokens, logprobs, sampled draws and exit caches as never taking it back."""
    prompts = _prompts(len(tok), 3, seed=75, lo=5, hi=20)
    params = [
        SamplingParams(max_tokens=9, logprobs=True),
        SamplingParams(max_tokens=7, temperature=0.9, seed=13),
        SamplingParams(max_tokens=11, temperature=1.2, top_p=0.8, seed=17),
    ]
    plans = [Plan(str(i), p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    plain, plain_exits, none_taken = _retracting_run(model, tok, plans, retract=False)
    taken_back, exits, taken = _retracting_run(model, tok, plans, retract=True)
    assert none_taken == 0
    assert taken >= 5
    for row_id, outputs in plain.items():
        assert [(o.token_id, o.logprob, o.finish_reason) for o in taken_back[row_id]] == [
            (o.token_id, o.logprob, o.finish_reason) for o in outputs
        ], row_id
        assert exits[row_id].cache_tokens == plain_exits[row_id].cache_tokens
        ours, theirs = cache_arrays(exits[row_id].cache), cache_arrays(plain_exits[row_id].cache)
        assert len(ours) == len(theirs) > 0
        assert all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs, strict=True)), row_id


def test_nothing_is_taken_back_in_mlx_order_or_after_a_row_left(model: Any, tok: Any) -> None:
    """retract() refuses where no unstarted forward is held: in mlx-lm's order (its forward is queued already), and after a step in which a row left (its slot became a hole: the built forward was touched)."""
    for flag in (False, True):
        batch = _short_and_long(model, tok, 76, read_first=flag, short=3, long=9)
        taken: list[bool] = []
        while True:
            result = batch.step()
            inner = batch._batch
            assert inner is not None
            if result.exits:
                assert [e.row_id for e in result.exits] == ["short"]
                assert inner.retract() is False
                break
            # NOTE: taken back or not, the next step carries on (all rows priming: it forwards twice).
            taken.append(inner.retract())
        assert taken, flag
        assert all(t is flag for t in taken), (flag, taken)
        batch.close()


def _operations(array: mx.array) -> int:
    """The operations still to run to compute ``array`` (0: it holds its values)."""
    out = io.StringIO()
    mx.export_to_dot(out, array)
    return out.getvalue().count("shape=rectangle")


def test_a_retract_leaves_the_layers_as_the_last_step_computed_them(model: Any, tok: Any) -> None:
    """After retract() every layer holds the keys and values the last step computed (nothing of the taken-back forward left to run) and the offsets from before the build."""
    batch = BatchGeneration(model, tok, prefill_step_size=64, read_first=True)
    for i, prompt in enumerate(_prompts(len(tok), 2, seed=77, lo=5, hi=12)):
        batch.join(str(i), prompt, SamplingParams(max_tokens=8))
    batch.step()
    batch.step()
    inner = batch._batch
    assert inner is not None
    layers: list[Any] = list(inner.prompt_cache)
    built = [c.offset.tolist() for c in layers]
    assert all(_operations(c.keys) > 0 for c in layers), "the step built no forward to take back"
    assert inner.retract()
    assert all(_operations(c.keys) == 0 and _operations(c.values) == 0 for c in layers)
    assert [c.offset.tolist() for c in layers] == [[o - 1 for o in offsets] for offsets in built]
    batch.close()


def test_a_checkpoint_capture_ends_what_a_retract_could_take_back(model: Any, tok: Any) -> None:
    """A step that captures a checkpoint boundary (its extraction evaluates the built forward) leaves nothing to take back; the steps between captures do."""
    batch = BatchGeneration(model, tok, prefill_step_size=64, read_first=True)
    (prompt,) = _prompts(len(tok), 1, seed=78, lo=7, hi=7)
    batch.join("a", prompt, SamplingParams(max_tokens=12), checkpoint_every=3)
    seen: list[tuple[int, bool]] = []
    while not batch.idle:
        result = batch.step()
        inner = batch._batch
        if inner is None or result.exits or not result.tokens:
            continue
        emitted = result.tokens[-1].index + 1
        # NOTE: a retract here would make the next step forward twice; the
        # probe takes nothing back, it only asks (and puts the batch back in step).
        held = inner._retract is not None
        seen.append((emitted, held))
    captured = [held for emitted, held in seen if emitted % 3 == 0]
    between = [held for emitted, held in seen if emitted % 3 != 0]
    assert captured, seen
    assert not any(captured), seen
    assert between, seen
    assert all(between), seen
    batch.close()
