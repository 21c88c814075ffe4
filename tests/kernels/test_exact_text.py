"""Completion text is exactly the decoded tokens: no first-token space is trimmed."""

from __future__ import annotations

from typing import Any

import pytest
from mlx_lm import load as mlx_load
from mlx_lm.tokenizer_utils import TokenizerWrapper

from kernels import Generation, SamplingParams, TextStream, run_generation

# NOTE: 50 prompts whose continuation usually begins with a space-led word,
# the case mlx-lm's detokenizers trim.
_STEMS = [
    "The capital of France is", "Water boils at", "My favourite colour is", "The quick brown fox",
    "Once upon a time there was", "In 1969 the first person to walk on the moon was",
    "Two plus two equals", "The largest planet in the solar system is", "Python is a",
    "The opposite of hot is", "A group of crows is called", "The chemical symbol for gold is",
    "Shakespeare wrote", "The speed of light is about", "Mount Everest is located in",
    "The first letter of the alphabet is", "Bees make", "The sun rises in the", "A triangle has",
    "The best way to learn is", "Coffee comes from", "The heart pumps", "Paris is famous for",
    "The Pacific Ocean is", "Cats like to", "Rain falls from", "The moon orbits",
    "A healthy breakfast includes", "Computers store data in", "The Great Wall of China is",
    "Music can make people", "The Amazon rainforest is", "Snow is made of", "A library is a place where",
    "Light travels faster than", "The human brain", "Dogs are known for", "Tomatoes are",
    "The Eiffel Tower was built in", "Ice melts when", "Trees produce", "An apple a day",
    "The ocean is salty because", "Birds can fly because", "The internet was invented",
    "Gold is valuable because", "A year has", "The colour of the sky is", "Friends are people who",
    "To make tea you need",
]


@pytest.fixture(scope="module")
def loaded(default_model_path: Any) -> tuple[Any, TokenizerWrapper]:
    """The default model and its tokenizer."""
    loaded = mlx_load(str(default_model_path))
    return loaded[0], loaded[1]


def test_text_stream_keeps_the_first_space_of_real_token_runs(loaded: tuple[Any, TokenizerWrapper]) -> None:
    """For 50 real continuations, the streamed text is decode(prompt + tokens) minus decode(prompt)."""
    _, tok = loaded
    assert len(_STEMS) == 50
    for stem in _STEMS:
        prompt = tok.encode(stem)
        tokens = tok.encode(stem + " and then some more words follow here.")[len(prompt):]
        stream = TextStream(tok.detokenizer)
        text = "".join(stream.add(t) for t in tokens) + stream.finish()
        full = tok.decode(prompt + tokens)
        assert full.startswith(tok.decode(prompt))
        assert text == full[len(tok.decode(prompt)):], stem
        assert text.startswith(" "), stem


def test_generated_text_is_the_decoded_tokens(loaded: tuple[Any, TokenizerWrapper]) -> None:
    """A real greedy generation's text equals the decoding of its tokens, leading space included."""
    model, tok = loaded
    for stem in _STEMS[:6]:
        prompt = tok.encode(stem)
        steps = list(run_generation(Generation(model, tok, prompt, SamplingParams(max_tokens=6))))
        # NOTE: an end-of-sequence token ends the text and releases none.
        ids = [s.token_id for s in steps if s.token_id not in tok.eos_token_ids]
        text = "".join(s.text for s in steps)
        assert text == tok.decode(prompt + ids)[len(tok.decode(prompt)):], stem
