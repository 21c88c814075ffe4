"""Piece-wise tokenizing of rendered chat prompts (kernels.engine._token_cache)."""

from __future__ import annotations

import types
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


class _Counting:
    """The real tokenizer, counting calls of its own ``encode`` (Hugging Face's, whose backend call leaves the GIL)."""

    def __init__(self, inner: Any, backend: Any = None) -> None:
        self._inner = inner
        self.encodes = 0
        self.backend_tokenizer = backend if backend is not None else inner.backend_tokenizer

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.encodes += 1
        return self._inner.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Backend:
    """The real backend behind a switch: its ``encode`` shifted by ``shift``; a ``truncation`` set at will."""

    def __init__(self, inner: Any, shift: int = 0) -> None:
        self._inner = inner
        self._shift = shift
        self.truncation: Any = None
        self.padding: Any = None

    def encode(self, text: str, add_special_tokens: bool = False) -> Any:
        enc = self._inner.encode(text, add_special_tokens=add_special_tokens)
        return types.SimpleNamespace(ids=[t + self._shift for t in enc.ids])


def _chat_text(tokenizer: Any) -> str:
    return str(tokenizer.apply_chat_template(_conversation(3), add_generation_prompt=True, tokenize=False))


def test_pieces_go_to_the_backend_which_keeps_the_gil(tokenizer: Any) -> None:
    """Once checked, a chat's pieces never go through Hugging Face's encode, whose backend call
    leaves the GIL (a switch interval each beside the engine thread); the ids are the tokenizer's own."""
    counting = _Counting(tokenizer)
    enc = PieceEncoder(counting)
    assert enc.direct
    assert enc.splits
    counting.encodes = 0
    text = _chat_text(tokenizer)
    assert enc.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    assert counting.encodes == 0
    prompt = "Once upon a time, café 你好"
    assert enc.plain(prompt, add_special_tokens=True) == list(tokenizer.encode(prompt))
    assert counting.encodes == 0


def test_a_backend_that_disagrees_is_not_used(tokenizer: Any) -> None:
    """A backend whose ids differ from the tokenizer's own fails the check: pieces go through the
    tokenizer, and the ids stay exact."""
    counting = _Counting(tokenizer, _Backend(tokenizer.backend_tokenizer, shift=1))
    enc = PieceEncoder(counting)
    assert not enc.direct
    counting.encodes = 0
    text = _chat_text(tokenizer)
    assert enc.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    assert counting.encodes > 0


def test_a_backend_that_truncates_is_passed_by(tokenizer: Any) -> None:
    """A checked backend that truncates later (a tokenizer.json setting) is not used while it does."""
    backend = _Backend(tokenizer.backend_tokenizer)
    counting = _Counting(tokenizer, backend)
    enc = PieceEncoder(counting)
    assert enc.direct
    backend.truncation = {"max_length": 4}
    counting.encodes = 0
    text = _chat_text(tokenizer)
    assert enc.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    assert counting.encodes > 0
