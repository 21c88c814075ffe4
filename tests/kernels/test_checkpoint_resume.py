"""A generation interrupted at a checkpoint, written to a real file and resumed, gives the uninterrupted answer."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels.cache import (
    CacheRegistry,
    GenerationCheckpoint,
    KvFileWriter,
    OsFilePort,
    materialize,
    plan_entry,
    read_header,
    read_tensors,
    tensor_bytes,
)
from kernels.engine import Generation
from kernels.engine._checkpoint import (
    CheckpointPoint,
    checkpoint_point,
    replay_pending,
    replay_step,
    resume_generation,
)
from messages.gateway import GenerationParams
from tests.tiny_models import kv_llama, tiny_mamba, tiny_tokenizer

PORT = OsFilePort()
KEY = "ab" * 16


@pytest.fixture(scope="module")
def tok() -> Any:
    return tiny_tokenizer()


def _run(gen: Generation, *, stop_after: int | None = None) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    while not gen.prefill_step():
        pass
    while gen.finish_reason is None:
        step = replay_step(gen)
        out.append((step.token_id, step.text))
        if stop_after is not None and len(out) == stop_after:
            break
    return out


def _checkpoint_file(gen: Generation, path: Path) -> CheckpointPoint:
    point = checkpoint_point(gen)
    assert point is not None
    record = GenerationCheckpoint(KEY, point.prompt_len, point.pending_token,
                                  len(point.generated), point.rng_key)
    plan = plan_entry(gen.cache, model_id="tiny", fingerprint="fp", namespace="",
                      tokenizer_hash="t", tokens=gen.cache_tokens, checkpoint=record)
    with KvFileWriter(PORT, plan) as w:
        w.begin(str(path.parent))
        for i in range(len(plan.tensors)):
            w.write_tensor(i, tensor_bytes(plan, i))
        plan.release_arrays()
        w.commit(str(path))
    return point


def _resume(model: Any, tok: Any, prompt: list[int], params: GenerationParams, path: Path) -> Generation:
    header = read_header(PORT, str(path), expected_fingerprint="fp")
    ck = header.checkpoint
    assert ck is not None
    caches = materialize(header, read_tensors(PORT, str(path), header, verify=True))
    point = CheckpointPoint(ck.prompt_len, header.tokens[ck.prompt_len:], ck.pending_token, ck.rng_key)
    return resume_generation(model, tok, prompt, params, caches, point)


PARAMS = [
    pytest.param(GenerationParams(max_tokens=48), id="greedy"),
    pytest.param(GenerationParams(max_tokens=48, temperature=0.8, seed=7), id="seeded-0.8"),
    pytest.param(GenerationParams(max_tokens=48, temperature=0.8, seed=3, top_p=0.9,
                                  repetition_penalty=1.3), id="seeded-penalty"),
]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("at", [1, 17, 40])
def test_resumed_answer_equals_uninterrupted(tmp_path: Path, tok: Any, params: GenerationParams,
                                             at: int) -> None:
    """Tokens and text of checkpoint -> file -> new generation -> replay + continue equal one run."""
    model = kv_llama(vocab_size=len(tok.vocab))
    prompt = tok.encode("The sea at night is")
    full = _run(Generation(model, tok, prompt, params))
    assert len(full) > at + 1  # NOTE: the cut is mid-answer: a pending token exists.
    first = Generation(model, tok, prompt, params)
    head = _run(first, stop_after=at)
    assert head == full[:at]
    path = tmp_path / "c.kvc"
    point = _checkpoint_file(first, path)
    assert point.pending_token == full[at][0]
    del first
    resumed = _resume(model, tok, prompt, params, path)
    assert replay_pending(resumed)
    assert checkpoint_point(resumed) is None
    again = _run(resumed)
    assert again == full
    assert "".join(t for _, t in again) == "".join(t for _, t in full)


def test_recurrent_model_resumes(tmp_path: Path, tok: Any) -> None:
    """A recurrent (Mamba) model, whose state cannot be trimmed to recompute, resumes from its pending token."""
    model = tiny_mamba(vocab_size=len(tok.vocab))
    params = GenerationParams(max_tokens=24, temperature=0.8, seed=11)
    prompt = tok.encode("Hello there")
    full = _run(Generation(model, tok, prompt, params))
    first = Generation(model, tok, prompt, params)
    _run(first, stop_after=9)
    path = tmp_path / "m.kvc"
    _checkpoint_file(first, path)
    assert _run(_resume(model, tok, prompt, params, path)) == full


def test_no_point_outside_the_boundary(tok: Any) -> None:
    """No checkpoint before the first token, or once the answer finished."""
    model = kv_llama(vocab_size=len(tok.vocab))
    gen = Generation(model, tok, tok.encode("abc"), GenerationParams(max_tokens=3))
    assert checkpoint_point(gen) is None
    _run(gen)
    assert gen.finish_reason is not None
    assert checkpoint_point(gen) is None


# -- every boundary ------------------------------------------------------------
#
# NOTE: the serving path in one process, at EVERY emitted token: the live
# generation is checkpointed through the registry's owned snapshot (what
# ``MlxBackend.capture_checkpoint`` takes, while the pending token's forward
# is queued), the snapshot goes through a real file, a new generation is
# resumed from it and its next tokens AND the logits behind them must be
# bit for bit the uninterrupted run's. The live run, snapshotted at every
# step, must itself stay bit for bit the uninterrupted run (a snapshot that
# shared a buffer the next forward writes would show here).


@dataclass(frozen=True)
class _Taken:
    """A registry snapshot at a boundary, not yet written."""

    at: int
    handle: str
    tokens: tuple[int, ...]
    record: GenerationCheckpoint


def _take(gen: Generation, registry: CacheRegistry) -> _Taken:
    point = checkpoint_point(gen)
    assert point is not None
    tokens = (*gen.prompt_tokens, *point.generated)
    reg = registry.snapshot(gen.cache, offset=len(tokens))
    record = GenerationCheckpoint(KEY, point.prompt_len, point.pending_token,
                                  len(point.generated), point.rng_key)
    return _Taken(len(point.generated), reg.handle, tokens, record)


def _write(taken: _Taken, registry: CacheRegistry, path: Path) -> None:
    plan = plan_entry(registry.get(taken.handle), model_id="m", fingerprint="fp", namespace="",
                      tokenizer_hash="t", tokens=taken.tokens, checkpoint=taken.record)
    with KvFileWriter(PORT, plan) as w:
        w.begin(str(path.parent))
        for i in range(len(plan.tensors)):
            w.write_tensor(i, tensor_bytes(plan, i))
        plan.release_arrays()
        w.commit(str(path))
    registry.dispose(taken.handle)
    registry.drain()


def _snapshot_file(gen: Generation, registry: CacheRegistry, path: Path) -> None:
    _write(_take(gen, registry), registry, path)


def _pending_logits(gen: Generation) -> np.ndarray[Any, Any] | None:
    # NOTE: the queued step's second value: raw logits for plain greedy,
    # log-probabilities otherwise; either way what the next token is drawn from.
    nxt = gen._next
    return None if nxt is None else np.array(nxt[1])


def _same(a: np.ndarray[Any, Any] | None, b: np.ndarray[Any, Any] | None) -> bool:
    """Both absent, or bit for bit equal."""
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(a, b))


def _sweep(model: Any, tok: Any, prompt: list[int], params: GenerationParams, boundaries: int,
           tmp_path: Path, *, ahead: int = 3, lag: int = 0) -> list[str]:
    """Checkpoint at every boundary 1..``boundaries``, resume each; the differences found.

    ``lag``: each snapshot is written to its file ``lag`` decode steps after
    it was taken (in serving, the SSD writer copies it in a later idle turn
    while the live generation keeps writing its own cache).
    """
    ref_tokens: list[int] = []
    ref_logits: list[np.ndarray[Any, Any] | None] = []
    gen = Generation(model, tok, prompt, params)
    while not gen.prefill_step():
        pass
    while gen.finish_reason is None:
        ref_tokens.append(gen.decode_step().token_id)
        ref_logits.append(_pending_logits(gen))
    assert len(ref_tokens) >= boundaries + max(ahead, lag) + 1, "the answer must run past every boundary"
    registry = CacheRegistry()
    path = tmp_path / "sweep.kvc"
    diffs: list[str] = []
    live = Generation(model, tok, prompt, params)
    while not live.prefill_step():
        pass
    waiting: deque[_Taken] = deque()
    k = 0
    while live.finish_reason is None:
        token = live.decode_step().token_id
        k += 1
        if token != ref_tokens[k - 1] or not _same(_pending_logits(live), ref_logits[k - 1]):
            diffs.append(f"live run with snapshots differs at token {k}")
            break
        if k <= boundaries:
            waiting.append(_take(live, registry))
        while waiting and waiting[0].at <= k - lag:
            taken = waiting.popleft()
            _write(taken, registry, path)
            diffs += _resumed_diffs(model, tok, prompt, params, path, taken.at, ref_tokens,
                                    ref_logits, ahead)
    assert not waiting, "every snapshot was written and resumed"
    return diffs


def _resumed_diffs(model: Any, tok: Any, prompt: list[int], params: GenerationParams, path: Path,
                   at: int, ref_tokens: list[int], ref_logits: list[np.ndarray[Any, Any] | None],
                   ahead: int) -> list[str]:
    resumed = _resume(model, tok, prompt, params, path)
    for _ in range(at):
        replay_step(resumed)
    for j in range(ahead):
        i = at + j
        out = resumed.decode_step()
        if out.token_id != ref_tokens[i] or not _same(_pending_logits(resumed), ref_logits[i]):
            return [f"resumed at {at}: token {i + 1} or its successor's logits differ"]
    return []


SWEEP_PARAMS = [
    GenerationParams(max_tokens=300, ignore_eos=True),
    GenerationParams(max_tokens=300, ignore_eos=True, temperature=0.8, seed=3, top_p=0.9,
                     repetition_penalty=1.3),
]


# NOTE: the default suite runs each sampling mode once and each lag once
# (greedy written late, seeded written at once); the other pairing is slow.
@pytest.mark.parametrize(("params", "lag"), [
    pytest.param(SWEEP_PARAMS[0], 7, id="greedy-7"),
    pytest.param(SWEEP_PARAMS[1], 0, id="seeded-penalty-0"),
    pytest.param(SWEEP_PARAMS[0], 0, id="greedy-0", marks=pytest.mark.slow),
    pytest.param(SWEEP_PARAMS[1], 7, id="seeded-penalty-7", marks=pytest.mark.slow),
])
def test_every_boundary_resumes_bitwise(tmp_path: Path, tok: Any, params: GenerationParams,
                                        lag: int) -> None:
    """Tiny Llama: a checkpoint at each of 290 boundaries (past the 256-slot KV growth), written now or 7 steps later, resumes bit for bit."""
    model = kv_llama(vocab_size=len(tok.vocab))
    prompt = tok.encode("The sea at night is dark and the lighthouse keeper watches it")
    assert _sweep(model, tok, prompt, params, 290, tmp_path, lag=lag) == []


@pytest.mark.slow
def test_default_model_every_boundary_resumes_bitwise(tmp_path: Path, default_model_path: Path) -> None:
    """Default model, the kill loop's greedy request: a checkpoint at each of 300 boundaries, written late, resumes bit for bit."""
    from kernels import load_model
    from tools.kill_loop_checkpoint import PROMPT

    lm = load_model(default_model_path)
    prompt = lm.tokenizer.encode(PROMPT)
    params = GenerationParams(max_tokens=310)
    # NOTE: each file written 7 steps after its snapshot, as the SSD writer's idle turn does.
    assert _sweep(lm.model, lm.tokenizer, prompt, params, 300, tmp_path, lag=7) == []


@pytest.mark.slow
def test_default_model_resumed_to_the_end_bitwise(tmp_path: Path, default_model_path: Path) -> None:
    """Default model, the kill loop's 400-token greedy answer resumed at 64/128/192/256 equals it to the last logit."""
    from kernels import load_model
    from tools.kill_loop_checkpoint import PROMPT

    lm = load_model(default_model_path)
    model, tok = lm.model, lm.tokenizer
    prompt = tok.encode(PROMPT)
    params = GenerationParams(max_tokens=400)
    ref: list[tuple[int, np.ndarray[Any, Any] | None]] = []
    gen = Generation(model, tok, prompt, params)
    while not gen.prefill_step():
        pass
    while gen.finish_reason is None:
        ref.append((gen.decode_step().token_id, _pending_logits(gen)))
    assert len(ref) == 400
    registry = CacheRegistry()
    for at in (64, 128, 192, 256):
        live = Generation(model, tok, prompt, params)
        while not live.prefill_step():
            pass
        for _ in range(at):
            live.decode_step()
        path = tmp_path / f"c{at}.kvc"
        _snapshot_file(live, registry, path)
        del live
        resumed = _resume(model, tok, prompt, params, path)
        got: list[tuple[int, np.ndarray[Any, Any] | None]] = []
        while resumed.finish_reason is None:
            got.append((replay_step(resumed).token_id, _pending_logits(resumed)))
        assert [t for t, _ in got] == [t for t, _ in ref], f"resumed at {at}: tokens differ"
        # NOTE: replayed steps queue no forward; from the pending token on, every logit is compared.
        assert all(_same(a, b) for (_, a), (_, b) in zip(got[at:], ref[at:], strict=True)), at
