"""Top log-probabilities from the sampled distribution, and tokens spelled as bytes."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import pytest

from kernels import Generation, SamplingParams, render_chat, run_generation
from kernels.engine import TokenBytes, top_logprobs
from tests.kernels.test_generation import lively_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    """A byte-level tokenizer covering every byte (multi-byte characters split across tokens)."""
    return tiny_tokenizer(all_bytes=True)


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny random llama over ``tok``'s vocabulary."""
    return lively_llama(len(tok._tokenizer))


def test_top_logprobs_are_the_k_largest_most_likely_first() -> None:
    """top_logprobs returns the k largest (id, value) pairs in descending order."""
    row = mx.array([-3.0, -0.5, -2.0, -0.1, -7.0])
    top = top_logprobs(row, 3)
    assert [t for t, _ in top] == [3, 1, 2]
    assert [v for _, v in top] == pytest.approx([-0.1, -0.5, -2.0])


def test_top_logprobs_break_ties_like_argmax() -> None:
    """Equal values are ordered by token id, so greedy's argmax is always first."""
    row = mx.array([-1.0, -0.5, -0.5, -0.5])
    ids = [t for t, _ in top_logprobs(row, 2)]
    assert ids == [1, 2]
    assert mx.argmax(row).item() == ids[0]


def test_top_logprobs_k_at_or_over_the_vocabulary_lists_every_token() -> None:
    """Asking for more alternatives than tokens returns each token once."""
    row = mx.array([-1.0, -2.0, -0.5])
    assert [t for t, _ in top_logprobs(row, 3)] == [2, 0, 1]
    assert [t for t, _ in top_logprobs(row, 20)] == [2, 0, 1]


def test_greedy_token_is_the_first_alternative(model: Any, tok: Any) -> None:
    """At temperature 0 every step's chosen token heads its top_logprobs with the same logprob."""
    prompt = render_chat(tok, [{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(max_tokens=12, logprobs=True, top_logprobs=5)
    out = run_generation(Generation(model, tok, prompt, params))
    assert len(out) == 12
    for step in out:
        assert len(step.top_logprobs) == 5
        assert step.top_logprobs[0][0] == step.token_id
        assert step.logprob is not None
        assert step.top_logprobs[0][1] == pytest.approx(step.logprob, abs=1e-6)
        values = [v for _, v in step.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert math.fsum(math.exp(v) for v in values) <= 1.0 + 1e-5


def test_logit_bias_shows_in_the_reported_distribution(model: Any, tok: Any) -> None:
    """Logprobs are those of the processed logits the token was drawn from (a +100 bias wins)."""
    prompt = render_chat(tok, [{"role": "user", "content": "Hi"}])
    target = int(tok.encode("Q", add_special_tokens=False)[0])
    params = SamplingParams(max_tokens=2, logprobs=True, top_logprobs=2, logit_bias={target: 100.0})
    out = run_generation(Generation(model, tok, prompt, params))
    assert [s.token_id for s in out] == [target, target]
    assert out[0].top_logprobs[0][0] == target
    assert out[0].top_logprobs[0][1] == pytest.approx(0.0, abs=1e-4)


def test_no_top_logprobs_unless_asked(model: Any, tok: Any) -> None:
    """Without top_logprobs the steps carry none (and no logprob without logprobs)."""
    prompt = render_chat(tok, [{"role": "user", "content": "Hi"}])
    out = run_generation(Generation(model, tok, prompt, SamplingParams(max_tokens=3)))
    assert all(s.top_logprobs == () and s.logprob is None for s in out)


def test_token_bytes_spell_byte_level_tokens_and_control_tokens(tok: Any) -> None:
    """Byte-level pieces map back to their bytes (a space, one byte of 'é'); control tokens to their text."""
    spell = TokenBytes(tok)
    ids = tok.encode(" é", add_special_tokens=False)
    assert b"".join(spell(ids)) == " é".encode()
    assert any(len(b) == 1 and b[0] >= 0x80 for b in spell(ids)), "é should split into single bytes"
    eos = tok.eos_token_id
    assert spell([eos]) == [b"</s>"]
    assert spell.eos_token_ids == frozenset(tok.eos_token_ids)


def test_one_alternative_is_the_maximum_lowest_id_among_ties() -> None:
    """k=1 gives the row's maximum, the lowest id among equal values (greedy's token)."""
    row = mx.array([-1.0, -0.5, -3.0, -0.5])
    [(token, value)] = top_logprobs(row, 1)
    assert token == 1
    assert value == pytest.approx(-0.5)
