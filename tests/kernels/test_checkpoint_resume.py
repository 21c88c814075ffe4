"""A generation interrupted at a checkpoint, written to a real file and resumed, gives the uninterrupted answer."""

from __future__ import annotations

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
from kernels.engine import Generation
from kernels.engine._checkpoint import (
    CheckpointPoint,
    checkpoint_point,
    replay_pending,
    replay_step,
    resume_generation,
)
from messages.gateway import GenerationParams
from tests.tiny_models import tiny_llama, tiny_mamba, tiny_tokenizer

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
    model = tiny_llama(vocab_size=len(tok.vocab))
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
    model = tiny_llama(vocab_size=len(tok.vocab))
    gen = Generation(model, tok, tok.encode("abc"), GenerationParams(max_tokens=3))
    assert checkpoint_point(gen) is None
    _run(gen)
    assert gen.finish_reason is not None
    assert checkpoint_point(gen) is None
