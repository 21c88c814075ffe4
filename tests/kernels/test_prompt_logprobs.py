"""Prompt scoring (``prompt_logprobs``): the prefill's own forwards give each prompt token's log-probability."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kernels import Generation, InvalidPrompt, SamplingParams, run_generation
from kernels.engine import PromptScorer, score_rows
from messages.gateway import PromptLogprobs
from tests.kernels.test_generation import lively_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    """A byte-level tokenizer covering every byte."""
    return tiny_tokenizer(all_bytes=True)


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny random llama over ``tok``'s vocabulary."""
    return lively_llama(len(tok._tokenizer))


def _reference(model: Any, prompt: list[int]) -> mx.array:
    """One forward of the whole prompt, float32 log-softmax: row i predicts token i + 1."""
    logits = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _prompt(tok: Any) -> list[int]:
    return [int(t) for t in tok.encode("The quick brown fox jumps over the lazy dog, twice.")]


@pytest.mark.parametrize("step", [2048, 7, 1])
def test_scores_equal_one_forwards_log_softmax(model: Any, tok: Any, step: int) -> None:
    """Every prompt token after the first is scored as the whole prompt's forward scores it, in any chunking."""
    prompt = _prompt(tok)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    out = run_generation(Generation(model, tok, prompt, params, prefill_step_size=step))
    scores = out[0].prompt_logprobs
    assert scores is not None
    assert all(o.prompt_logprobs is None for o in out[1:])
    ref = _reference(model, prompt)
    assert scores.token_ids == tuple(prompt)
    assert len(scores.logprobs) == len(prompt) - 1
    want = [ref[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert scores.logprobs == pytest.approx(want, abs=1e-4)
    assert scores.top == 3
    for i in range(len(prompt) - 1):
        ids = scores.top_ids[3 * i : 3 * i + 3]
        values = scores.top_logprobs[3 * i : 3 * i + 3]
        row = cast("list[float]", ref[i].tolist())
        expect = sorted(range(len(row)), key=lambda t: -row[t])[:3]
        assert list(ids) == expect
        assert list(values) == sorted(values, reverse=True)
        assert values[0] == pytest.approx(ref[i, expect[0]].item(), abs=1e-4)


def test_greedy_prompt_token_equals_its_first_alternative(model: Any, tok: Any) -> None:
    """A prompt continued by the model's own greedy tokens: each of those is the first alternative, same value."""
    seed = _prompt(tok)
    greedy = [o.token_id for o in run_generation(
        Generation(model, tok, seed, SamplingParams(max_tokens=6)))]
    prompt = seed + greedy
    gen = Generation(model, tok, prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    scores = run_generation(gen)[0].prompt_logprobs
    assert scores is not None
    for i in range(len(seed) - 1, len(prompt) - 1):
        assert scores.top_ids[i] == prompt[i + 1]
        # NOTE: exactly equal: lm-eval's is_greedy compares them with ==.
        assert scores.logprobs[i] == scores.top_logprobs[i]


def test_zero_alternatives_scores_only_the_prompt_tokens(model: Any, tok: Any) -> None:
    """prompt_logprobs=0: each token's logprob, no alternatives."""
    prompt = _prompt(tok)
    out = run_generation(Generation(model, tok, prompt, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    scores = out[0].prompt_logprobs
    assert scores is not None
    assert scores.top == 0
    assert scores.top_ids == ()
    assert len(scores.logprobs) == len(prompt) - 1


def test_without_prompt_logprobs_nothing_is_scored(model: Any, tok: Any) -> None:
    """The default request carries no prompt scores."""
    out = run_generation(Generation(model, tok, _prompt(tok), SamplingParams(max_tokens=2)))
    assert all(o.prompt_logprobs is None for o in out)


def test_a_reused_prefix_is_refused_when_scoring(model: Any, tok: Any) -> None:
    """A cached prefix has no logits: scoring needs the whole prompt forwarded."""
    prompt = _prompt(tok)
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:4])[None], cache=cache)
    mx.eval([c.state for c in cache])
    with pytest.raises(InvalidPrompt, match="prompt_logprobs"):
        Generation(model, tok, prompt, SamplingParams(max_tokens=1, prompt_logprobs=0),
                   cache=cache, cached_tokens=4)


def test_scoring_chunks_are_bounded_by_the_vocabulary(model: Any, tok: Any) -> None:
    """A scoring forward holds at most SCORE_ELEMENTS logits: its chunk is cut to score_rows(vocab)."""
    vocab = len(tok._tokenizer)
    assert score_rows(vocab) * vocab <= (1 << 23)
    assert score_rows(1 << 30) == 1
    prompt = _prompt(tok)
    gen = Generation(model, tok, prompt, SamplingParams(max_tokens=1, prompt_logprobs=0),
                     prefill_step_size=4096)
    assert gen._step_size == min(4096, score_rows(vocab))


def test_scorer_takes_rows_in_order() -> None:
    """Scores arrive position by position; a gap is a bug, refused."""
    scorer = PromptScorer([1, 2, 3], 0)
    with pytest.raises(ValueError, match="in order"):
        scorer.add(mx.zeros((1, 8)), 1)


def test_prompt_logprobs_shape_is_checked() -> None:
    """The message refuses scores that do not match the prompt."""
    with pytest.raises(ValueError):
        PromptLogprobs(token_ids=(1, 2, 3), logprobs=(-1.0,))
    with pytest.raises(ValueError):
        PromptLogprobs(token_ids=(1, 2), logprobs=(-1.0,), top=2, top_ids=(1,), top_logprobs=(-1.0,))


def test_one_alternative_is_each_rows_maximum_lowest_id_among_ties() -> None:
    """top 1 (the harnesses' ``logprobs: 1``) reports each row's most likely token, the lowest id among equals."""
    rows = [[0.0, 2.0, 2.0, 1.0, -1.0], [3.0, 0.5, 3.0, 3.0, 0.0], [-2.0, -1.0, 0.0, 4.0, 4.5]]
    scorer = PromptScorer([4, 0, 3, 1], 1)
    scorer.add(mx.array(rows), 0)
    scores = scorer.result()
    assert scores.top_ids == (1, 0, 4)
    lse = mx.logsumexp(mx.array(rows), axis=-1)
    want = [rows[i][t] - lse[i].item() for i, t in enumerate((1, 0, 4))]
    assert list(scores.top_logprobs) == pytest.approx(want, abs=1e-6)
    assert list(scores.logprobs) == pytest.approx(
        [rows[i][t] - lse[i].item() for i, t in enumerate((0, 3, 1))], abs=1e-6)
