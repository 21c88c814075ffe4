"""Batch-lane generation checkpoints: a row checkpointed, written to a real file and resumed
into a new batch continues token for token like the uninterrupted batch run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kernels.cache import (
    GenerationCheckpoint,
    KvFileWriter,
    OsFilePort,
    materialize,
    plan_entry,
    read_header,
    read_tensors,
    tensor_bytes,
)
from kernels.engine import (
    REPLAY_PER_STEP,
    BatchGeneration,
    CheckpointPoint,
    RowCheckpoint,
)
from messages.gateway import GenerationParams
from tests.tiny_models import tiny_mamba

PORT = OsFilePort()
KEY = "cd" * 16
EVERY = 8


@dataclass
class Out:
    """What a driven batch produced: per row, (token, text) in order and the checkpoints taken."""

    tokens: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    checkpoints: dict[str, list[RowCheckpoint]] = field(default_factory=dict)
    decode_rows: list[int] = field(default_factory=list)


def _drive(batch: BatchGeneration, *, max_steps: int = 500, out: Out | None = None) -> Out:
    out = Out() if out is None else out
    for _ in range(max_steps):
        if batch.idle:
            return out
        step = batch.step()
        out.decode_rows.append(step.decode_rows)
        for t in step.tokens:
            row = out.tokens.setdefault(t.row_id, [])
            assert t.index == len(row)
            row.append((t.output.token_id, t.output.text))
        for c in step.checkpoints:
            out.checkpoints.setdefault(c.row_id, []).append(c)
    if batch.idle or max_steps < 500:
        return out
    raise AssertionError("the batch did not drain")


def _write(ck: RowCheckpoint, path: Path) -> None:
    record = GenerationCheckpoint(KEY, ck.prompt_len, ck.pending_token, ck.sample_index,
                                  ck.rng_key)
    plan = plan_entry(ck.cache, model_id="tiny", fingerprint="fp", namespace="",
                      tokenizer_hash="t", tokens=ck.cache_tokens, checkpoint=record)
    with KvFileWriter(PORT, plan) as w:
        w.begin(str(path.parent))
        for i in range(len(plan.tensors)):
            w.write_tensor(i, tensor_bytes(plan, i))
        plan.release_arrays()
        w.commit(str(path))


def _read(path: Path) -> tuple[list[Any], CheckpointPoint]:
    header = read_header(PORT, str(path), expected_fingerprint="fp")
    ck = header.checkpoint
    assert ck is not None
    caches = materialize(header, read_tensors(PORT, str(path), header, verify=True))
    point = CheckpointPoint(ck.prompt_len, tuple(header.tokens[ck.prompt_len:]),
                            ck.pending_token, ck.rng_key)
    return caches, point


PARAMS = [
    pytest.param(GenerationParams(max_tokens=40), id="greedy"),
    pytest.param(GenerationParams(max_tokens=40, temperature=0.8, seed=7), id="seeded-0.8"),
    pytest.param(GenerationParams(max_tokens=40, temperature=0.8, seed=5, top_p=0.9,
                                  repetition_penalty=1.3), id="seeded-penalty"),
    pytest.param(GenerationParams(max_tokens=40, frequency_penalty=1.5,
                                  frequency_context_size=64), id="greedy-frequency"),
]


@pytest.mark.parametrize("params", PARAMS)
def test_resumed_batch_row_equals_the_uninterrupted_batch_run(
    tmp_path: Path, model: Any, tok: Any, params: GenerationParams
) -> None:
    """Checkpoint -> real file -> join_resumed replays the saved tokens and continues like one run."""
    prompt = tok.encode("The sea at night is")
    first = BatchGeneration(model, tok, max_rows=4, prefill_step_size=16)
    first.join("a", prompt, params, checkpoint_every=EVERY)
    full = _drive(first)
    answer = full.tokens["a"]
    taken = full.checkpoints["a"]
    # NOTE: one every EVERY emitted tokens that did not end the row.
    assert [c.sample_index for c in taken] == list(range(EVERY, len(answer), EVERY))
    ck = taken[1]
    assert ck.cache_tokens == (*prompt, *(t for t, _ in answer[: ck.sample_index]))
    assert ck.pending_token == answer[ck.sample_index][0]
    assert (ck.rng_key is None) == params.greedy
    path = tmp_path / "row.kvc"
    _write(ck, path)
    caches, point = _read(path)
    again = BatchGeneration(model, tok, max_rows=4, prefill_step_size=16)
    again.join_resumed("a", prompt, params, cache=caches, point=point, checkpoint_every=EVERY)
    resumed = _drive(again)
    assert resumed.tokens["a"] == answer
    # NOTE: no target forward: the replay steps decode nothing, the first
    # decode step's token is the pending one.
    assert resumed.decode_rows[0] == 0
    assert [c.sample_index for c in resumed.checkpoints["a"]] == \
        [c.sample_index for c in taken if c.sample_index > ck.sample_index]


def test_checkpointed_row_beside_rows_without(model: Any, tok: Any) -> None:
    """Only the row that asked checkpoints; every row's tokens are those of its run without any checkpoint."""
    params = GenerationParams(max_tokens=30, temperature=0.8, seed=3)
    prompts = {"a": tok.encode("Once upon a time"), "b": tok.encode("Hello"),
               "c": tok.encode("A long way off, far")}

    def run(every: int) -> Out:
        batch = BatchGeneration(model, tok, max_rows=4, prefill_step_size=16)
        for rid, prompt in prompts.items():
            batch.join(rid, prompt, params, checkpoint_every=every if rid == "b" else 0)
        return _drive(batch)

    plain, checked = run(0), run(EVERY)
    assert set(checked.checkpoints) == {"b"}
    assert not plain.checkpoints
    assert checked.tokens == plain.tokens
    assert max(checked.decode_rows) == 3


def test_resumed_row_joins_a_running_batch_and_replays_in_chunks(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """A resumed row joins while others decode: it replays REPLAY_PER_STEP tokens a step, then decodes with them."""
    params = GenerationParams(max_tokens=REPLAY_PER_STEP + 30)
    prompt = tok.encode("Beyond the hills")
    first = BatchGeneration(model, tok, max_rows=4, prefill_step_size=16)
    first.join("a", prompt, params, checkpoint_every=REPLAY_PER_STEP + 8)
    full = _drive(first)
    (ck,) = full.checkpoints["a"]
    path = tmp_path / "row.kvc"
    _write(ck, path)
    caches, point = _read(path)
    again = BatchGeneration(model, tok, max_rows=4, prefill_step_size=16)
    again.join("x", tok.encode("Other words here"), GenerationParams(max_tokens=60))
    out = _drive(again, max_steps=3)
    assert out.decode_rows[-1] == 1
    again.join_resumed("a", prompt, params, cache=caches, point=point)
    assert "a" in again.pending
    _drive(again, max_steps=1, out=out)
    assert len(out.tokens["a"]) == REPLAY_PER_STEP
    _drive(again, out=out)
    assert out.tokens["a"] == full.tokens["a"]


def test_no_checkpoint_when_the_pending_token_is_the_last(model: Any, tok: Any) -> None:
    """A boundary whose pending token is the last max_tokens allows takes no checkpoint (nothing left to save)."""
    batch = BatchGeneration(model, tok, max_rows=2, prefill_step_size=16)
    batch.join("a", tok.encode("Hello"), GenerationParams(max_tokens=2 * EVERY + 2),
               checkpoint_every=EVERY)
    out = _drive(batch)
    assert len(out.tokens["a"]) == 2 * EVERY + 2
    assert [c.sample_index for c in out.checkpoints["a"]] == [EVERY, 2 * EVERY]
    batch = BatchGeneration(model, tok, max_rows=2, prefill_step_size=16)
    batch.join("a", tok.encode("Hello"), GenerationParams(max_tokens=EVERY + 1),
               checkpoint_every=EVERY)
    assert "a" not in _drive(batch).checkpoints


def test_the_step_after_a_boundary_hands_out_its_checkpoint_with_that_steps_token(
    model: Any, tok: Any
) -> None:
    """A boundary's checkpoint comes with the next step, whose emitted token is its pending one."""
    batch = BatchGeneration(model, tok, max_rows=2, prefill_step_size=16)
    batch.join("a", tok.encode("The sea at night is"), GenerationParams(max_tokens=3 * EVERY),
               checkpoint_every=EVERY)
    emitted: list[int] = []
    seen: list[tuple[int, RowCheckpoint]] = []
    while not batch.idle:
        step = batch.step()
        emitted.extend(t.output.token_id for t in step.tokens)
        seen.extend((len(emitted), c) for c in step.checkpoints)
    assert [c.sample_index for _, c in seen] == [EVERY, 2 * EVERY]
    for after, ck in seen:
        # NOTE: handed out once the pending token was emitted, not before.
        assert after == ck.sample_index + 1
        assert ck.pending_token == emitted[ck.sample_index]


def test_a_boundary_step_queues_the_snapshot_instead_of_waiting_for_it(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No synchronous evaluation is ever asked for a checkpoint's snapshot arrays: their copy is queued."""
    import mlx.core as mx

    from kernels.cache import cache_arrays

    batch = BatchGeneration(model, tok, max_rows=2, prefill_step_size=16)
    batch.join("a", tok.encode("Hello there"), GenerationParams(max_tokens=3 * EVERY),
               checkpoint_every=EVERY)
    evaluated: list[Any] = []  # NOTE: the arrays themselves: their ids cannot be reused.
    real_eval = mx.eval

    def spy_eval(*args: Any, **kwargs: Any) -> None:
        stack = list(args)
        while stack:
            a = stack.pop()
            if isinstance(a, list | tuple):
                stack.extend(a)
            else:
                evaluated.append(a)
        real_eval(*args, **kwargs)

    monkeypatch.setattr(mx, "eval", spy_eval)
    out = _drive(batch)
    taken = out.checkpoints["a"]
    assert taken
    asked = {id(a) for a in evaluated}
    for ck in taken:
        assert not asked & {id(a) for a in cache_arrays(ck.cache)}


def test_recurrent_row_resumes(tmp_path: Path, tok: Any) -> None:
    """A Mamba row (recurrent state, no trim) resumes from its pending token like the uninterrupted run."""
    model = tiny_mamba(vocab_size=len(tok.vocab))
    params = GenerationParams(max_tokens=24, temperature=0.8, seed=11)
    prompt = tok.encode("Hello there")
    first = BatchGeneration(model, tok, max_rows=2, prefill_step_size=16)
    first.join("m", prompt, params, checkpoint_every=EVERY)
    full = _drive(first)
    ck = full.checkpoints["m"][0]
    path = tmp_path / "m.kvc"
    _write(ck, path)
    caches, point = _read(path)
    again = BatchGeneration(model, tok, max_rows=2, prefill_step_size=16)
    again.join_resumed("m", prompt, params, cache=caches, point=point)
    assert _drive(again).tokens["m"] == full.tokens["m"]


def test_cancel_while_replaying_returns_the_restored_cache(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """A resumed row cancelled mid-replay leaves with the checkpoint's cache and every saved token."""
    params = GenerationParams(max_tokens=REPLAY_PER_STEP + 30)
    prompt = tok.encode("Beyond the hills")
    first = BatchGeneration(model, tok, max_rows=2, prefill_step_size=16)
    first.join("a", prompt, params, checkpoint_every=REPLAY_PER_STEP + 8)
    (ck,) = _drive(first).checkpoints["a"]
    _write(ck, tmp_path / "r.kvc")
    caches, point = _read(tmp_path / "r.kvc")
    again = BatchGeneration(model, tok, max_rows=2, prefill_step_size=16)
    again.join_resumed("a", prompt, params, cache=caches, point=point)
    again.step()
    gone = again.cancel("a")
    assert gone.cache_tokens == ck.cache_tokens
    assert gone.completion_tokens == REPLAY_PER_STEP
    assert again.idle


def test_resume_refuses_what_does_not_fit(tmp_path: Path, model: Any, tok: Any) -> None:
    """A checkpoint of another prompt length, past max_tokens or of the wrong sampler kind is refused, nothing added."""
    from kernels import InvalidPrompt

    params = GenerationParams(max_tokens=30)
    prompt = tok.encode("Beyond the hills")
    first = BatchGeneration(model, tok, max_rows=2, prefill_step_size=16)
    first.join("a", prompt, params, checkpoint_every=EVERY)
    ck = _drive(first).checkpoints["a"][0]
    _write(ck, tmp_path / "r.kvc")
    caches, point = _read(tmp_path / "r.kvc")
    batch = BatchGeneration(model, tok, max_rows=2, prefill_step_size=16)
    with pytest.raises(InvalidPrompt):
        batch.join_resumed("a", prompt[:-1], params, cache=caches, point=point)
    with pytest.raises(InvalidPrompt):
        batch.join_resumed("a", prompt, GenerationParams(max_tokens=EVERY + 1), cache=caches,
                           point=point)
    with pytest.raises(InvalidPrompt):
        batch.join_resumed("a", prompt, GenerationParams(max_tokens=30, temperature=0.8, seed=1),
                           cache=caches, point=point)
    assert batch.idle
