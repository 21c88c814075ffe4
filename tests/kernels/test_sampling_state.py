"""The per-request sampler keeps no shared state: one request's failure cannot break the next."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kernels import SamplingParams, make_request_sampler

VOCAB = 100


def _logprobs(seed: int = 0) -> mx.array:
    logits = mx.random.normal((1, VOCAB), key=mx.random.key(seed))
    return logits - mx.logsumexp(logits, keepdims=True)


def _global_key() -> object:
    state: Any = mx.random.state
    return state[0]


def _draw(params: SamplingParams, **kw: object) -> int:
    token = make_request_sampler(params, **kw)(_logprobs())  # type: ignore[arg-type]
    return int(token.item())  # type: ignore[arg-type]


@pytest.mark.parametrize("top_k", [VOCAB, VOCAB + 1, 1_000_000, 2**62])
def test_top_k_at_or_above_vocab_keeps_unseeded_sampling_working(top_k: int) -> None:
    """top_k >= vocab with temperature > 0 samples (no filter), and later unseeded requests still sample."""
    assert 0 <= _draw(SamplingParams(temperature=0.7)) < VOCAB
    assert 0 <= _draw(SamplingParams(temperature=0.8, top_k=top_k)) < VOCAB
    for _ in range(3):
        assert 0 <= _draw(SamplingParams(temperature=0.7)) < VOCAB


def test_top_k_at_vocab_filters_nothing() -> None:
    """With a seed, top_k equal to the vocabulary draws exactly what no top_k draws."""
    plain = [_draw(SamplingParams(temperature=1.0, seed=s)) for s in range(8)]
    at_vocab = [_draw(SamplingParams(temperature=1.0, seed=s, top_k=VOCAB)) for s in range(8)]
    assert plain == at_vocab


def test_sampling_never_touches_the_global_random_state() -> None:
    """Unseeded and seeded samplers, every filter on, leave MLX's global key untouched."""
    mx.random.seed(1)
    before = _global_key()
    params = [
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.9, top_p=0.8, min_p=0.05, top_k=10, xtc_probability=0.5),
        SamplingParams(temperature=0.9, seed=4, top_k=3, xtc_probability=0.5),
    ]
    for p in params:
        mx.eval(make_request_sampler(p, xtc_special_tokens=[1, 2])(_logprobs()))
    assert _global_key() is before


def test_a_failing_request_leaves_the_next_one_working() -> None:
    """A sampler that raises mid-draw (bad input) does not break a later unseeded request."""
    broken = make_request_sampler(SamplingParams(temperature=0.8, top_k=5))
    with pytest.raises(ValueError, match="zero size"):
        mx.eval(broken(mx.zeros((0,))))
    assert 0 <= _draw(SamplingParams(temperature=0.8, top_k=5)) < VOCAB
    assert 0 <= _draw(SamplingParams(temperature=0.8)) < VOCAB


def test_unseeded_requests_draw_their_seed_from_the_port() -> None:
    """An unseeded request is seeded by the injected source: it then equals that explicit seed."""
    draws = [_draw(SamplingParams(temperature=1.0, top_p=0.9), seed_source=lambda: 42) for _ in range(3)]
    assert draws == [_draw(SamplingParams(temperature=1.0, top_p=0.9, seed=42))] * 3
