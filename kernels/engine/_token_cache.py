"""Tokenizing rendered chat prompts piece by piece, with the pieces cached.

A long conversation is re-rendered and re-tokenized on every turn, and on a
fast GPU that costs more than the cached prefill it precedes (8k tokens:
~20 ms of tokenizing against ~15 ms from the cache hit to the first token).
Most of the text is unchanged from the previous turn, so the tokenizer's
work can be cached — but only at boundaries where tokenization is local.

Special (added) tokens are such boundaries: a fast tokenizer splits the text
at its added tokens BEFORE normalization and BPE run, and encodes each piece
between them on its own. So ``encode(a + SPECIAL + b)`` equals
``encode(a) + [id(SPECIAL)] + encode(b)``, and the piece ``a`` (a whole
system prompt or message, as chat templates put control tokens around every
turn) can be looked up instead of re-encoded.

The equivalence depends on the tokenizer (an added token with ``lstrip`` or
``rstrip`` swallows neighbouring spaces, for example), so each tokenizer is
checked once, on a probe text that exercises every special token, against
its own whole-text encoding; a tokenizer that fails the check is never
split and never cached.

Every piece is encoded by the fast tokenizer's backend directly
(``tokenizers.Tokenizer.encode``) where it has one: Hugging Face's
``encode`` goes through the backend's ``encode_batch``, which leaves the GIL
and must take it back, and beside a thread that holds the GIL (the engine
thread building its steps) each such call waited a switch interval, ~5 ms:
a render of nine uncached pieces took 39 ms instead of 0.4
(``tools/bench/render_gil.py``, docs/benchmarks.md 2026-12-06 15:10). The
backend's ``encode`` keeps the GIL. It is used only where it gives the
tokenizer's own ids on a probe of every special token (checked once, like
the split) and while the backend neither truncates nor pads.

Pure tokenizer work (no MLX): safe on any thread; the cache takes a lock.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_TOKEN_CACHE_CHARS", "PieceEncoder", "piece_encoder"]

DEFAULT_TOKEN_CACHE_CHARS = 16 * 1024 * 1024
"""Characters of text whose token ids are kept per tokenizer (about 4M tokens, ~100 MB)."""

_PROBE_BODY = "Hello, world!  Two  spaces\nnew line\t tab. caf\u00e9 \u4f60\u597d 123 "
"""Plain text of the encoder's checks: double spaces, a newline, a tab, accents, CJK, digits."""

# NOTE: pieces shorter than this are cheaper to encode than to hash and store.
_MIN_CACHED_PIECE = 256


class PieceEncoder:
    """Encodes rendered text split at special tokens, caching long pieces (LRU, char-capped)."""

    def __init__(self, tokenizer: Any, *, max_chars: int = DEFAULT_TOKEN_CACHE_CHARS) -> None:
        self._tokenizer = tokenizer
        self._max_chars = max_chars
        self._lock = threading.Lock()
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self.hits = 0
        self.misses = 0
        specials = _special_ids(tokenizer)
        self._special_ids = specials
        self._pattern = (
            re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
            if specials
            else None
        )
        self._backend: Any = _backend(tokenizer)
        if self._backend is not None and not self._backend_check():
            self._backend = None
        self.splits = self._pattern is not None and self._self_check()

    @property
    def direct(self) -> bool:
        """Whether pieces are encoded by the backend directly (keeping the GIL)."""
        return self._backend is not None

    def plain(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=...)`` (no split, no cache), by the backend
        directly where it passed the check."""
        backend = self._backend
        if backend is not None and _plain(backend):
            return [int(t) for t in backend.encode(text, add_special_tokens=add_special_tokens).ids]
        return [int(t) for t in self._tokenizer.encode(text, add_special_tokens=add_special_tokens)]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` exactly as ``tokenizer.encode(text, add_special_tokens=False)``."""
        if not self.splits:
            return self._whole(text)
        assert self._pattern is not None
        ids: list[int] = []
        pos = 0
        for match in self._pattern.finditer(text):
            if match.start() > pos:
                ids += self._piece(text[pos : match.start()])
            ids.append(self._special_ids[match.group(0)])
            pos = match.end()
        if pos < len(text):
            ids += self._piece(text[pos:])
        return ids

    def _whole(self, text: str) -> list[int]:
        return self.plain(text)

    def _backend_check(self) -> bool:
        """Whether the backend's ``encode`` gives the tokenizer's own ids, with and without its
        special tokens added, on texts that hold every special token."""
        body = _PROBE_BODY
        texts = [body, " x", "\n", *(f"{body}{s}\n{s}{s} x{s}" for s in self._special_ids)]
        try:
            # NOTE: the tokenizer's own first: its ``encode`` turns the backend's
            # truncation and padding off (a tokenizer.json may set them).
            want = [[int(t) for t in self._tokenizer.encode(t, add_special_tokens=a)]
                    for a in (False, True) for t in texts]
            backend = self._backend
            return _plain(backend) and want == [
                [int(t) for t in backend.encode(t, add_special_tokens=a).ids]
                for a in (False, True) for t in texts]
        except Exception:  # noqa: BLE001 - NOTE: any backend oddity means "through the tokenizer"
            return False

    def _piece(self, piece: str) -> list[int]:
        if len(piece) < _MIN_CACHED_PIECE or len(piece) > self._max_chars:
            return self._whole(piece)
        with self._lock:
            cached = self._pieces.get(piece)
            if cached is not None:
                self._pieces.move_to_end(piece)
                self.hits += 1
                return list(cached)
        ids = self._whole(piece)
        with self._lock:
            self.misses += 1
            if piece not in self._pieces:
                self._pieces[piece] = tuple(ids)
                self._chars += len(piece)
                while self._chars > self._max_chars:
                    old, _ = self._pieces.popitem(last=False)
                    self._chars -= len(old)
        return ids

    def _self_check(self) -> bool:
        """Whether split encoding equals whole-text encoding on a probe with every special."""
        body = _PROBE_BODY * 3
        probe = "".join(f"{body}{s}\n{body}{s}{s} x{s}" for s in self._special_ids) + body
        saved, self.splits = getattr(self, "splits", False), True
        try:
            return self.encode(probe) == self._whole(probe)
        except Exception:  # noqa: BLE001 - NOTE: any tokenizer oddity means "do not split"
            return False
        finally:
            self.splits = saved
            self._pieces.clear()
            self._chars = 0
            self.hits = self.misses = 0


def _backend(tokenizer: Any) -> Any:
    """A Hugging Face fast tokenizer's backend (``tokenizers.Tokenizer``), if it has one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if callable(getattr(backend, "encode", None)) else None


def _plain(backend: Any) -> bool:
    """Whether the backend neither truncates nor pads (``encode`` without those options)."""
    return getattr(backend, "truncation", None) is None and getattr(backend, "padding", None) is None


def _special_ids(tokenizer: Any) -> dict[str, int]:
    """Spelling -> id of the tokenizer's special added tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(added, Mapping):
        return {}
    out: dict[str, int] = {}
    for token_id, token in added.items():
        content = str(getattr(token, "content", ""))
        if getattr(token, "special", False) and content:
            out[content] = int(token_id)
    return out


_ENCODERS: weakref.WeakKeyDictionary[Any, PieceEncoder] = weakref.WeakKeyDictionary()
_ENCODERS_LOCK = threading.Lock()


def piece_encoder(tokenizer: Any) -> PieceEncoder:
    """The (one, lazily built) piece encoder of ``tokenizer``."""
    with _ENCODERS_LOCK:
        enc = _ENCODERS.get(tokenizer)
        if enc is None:
            enc = PieceEncoder(tokenizer)
            _ENCODERS[tokenizer] = enc
        return enc
