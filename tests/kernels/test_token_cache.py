"""Piece-wise tokenizing of rendered chat prompts (kernels.engine._token_cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from kernels.engine import render_chat
from kernels.engine._token_cache import PieceEncoder

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    return load_tokenizer(default_model_path)


def _conversation(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": " ".join(f"Rule {i}: be brief." for i in range(300))}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: what is {i} + {i}?  Two  spaces."})
        msgs.append({"role": "assistant", "content": f"It is {2 * i}.\n\nAnything else?"})
    msgs.append({"role": "user", "content": "Thanks <b>a lot</b>."})
    return msgs


def test_split_encoding_equals_whole_encoding_on_the_default_template(tokenizer: Any) -> None:
    """Every turn of a growing conversation tokenizes exactly as the whole text does."""
    enc = PieceEncoder(tokenizer)
    assert enc.splits
    for turns in range(5):
        text = str(tokenizer.apply_chat_template(
            _conversation(turns), add_generation_prompt=True, tokenize=False))
        assert enc.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))


def test_unchanged_pieces_come_from_the_cache(tokenizer: Any) -> None:
    """The next turn of a conversation re-encodes only its new pieces (the system prompt is a hit)."""
    enc = PieceEncoder(tokenizer)
    first = str(tokenizer.apply_chat_template(_conversation(1), add_generation_prompt=True, tokenize=False))
    second = str(tokenizer.apply_chat_template(_conversation(2), add_generation_prompt=True, tokenize=False))
    enc.encode(first)
    hits = enc.hits
    enc.encode(second)
    assert enc.hits > hits


def test_render_chat_equals_the_template_tokenizing_itself(tokenizer: Any) -> None:
    """render_chat returns what apply_chat_template(tokenize=True) returns, turn after turn."""
    for turns in (0, 3, 3):
        msgs = _conversation(turns)
        want = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        assert render_chat(tokenizer, msgs) == [int(t) for t in want]


class _StrippingTokenizer:
    """A tokenizer whose special token eats the spaces after it (``rstrip``), as some do."""

    class _Added:
        content = "<sep>"
        special = True

    added_tokens_decoder = {7: _Added()}  # noqa: RUF012

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out: list[int] = []
        i = 0
        while i < len(text):
            if text.startswith("<sep>", i):
                out.append(7)
                i += 5
                while i < len(text) and text[i] == " ":
                    i += 1
                continue
            out.append(100 + ord(text[i]))
            i += 1
        return out


def test_a_tokenizer_that_is_not_local_at_specials_is_never_split() -> None:
    """The self-check refuses a tokenizer whose specials change their neighbours; encoding stays exact."""
    tok = _StrippingTokenizer()
    enc = PieceEncoder(tok)
    assert not enc.splits
    text = "a <sep>  b" * 100
    assert enc.encode(text) == tok.encode(text)
