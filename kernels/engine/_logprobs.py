"""Log-probabilities of generated tokens: the most likely alternatives, and tokens as bytes.

:func:`top_logprobs` runs on the engine thread, over the very
log-probabilities the sampler drew from (after logit bias, penalties and a
grammar's mask; before temperature and the top-p/k filters, as mlx-lm
reports them). :class:`TokenBytes` is tokenizer work only (no MLX): the HTTP
edge uses it to spell each reported token.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Iterable
from typing import Any, cast

import mlx.core as mx

__all__ = ["TokenBytes", "top_logprobs"]


def top_logprobs(logprobs: mx.array, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely ``(token_id, logprob)`` pairs of a ``(vocab,)`` row, most likely first.

    Ties are ordered by token id, the order ``argmax`` breaks them in, so at
    temperature 0 the sampled token is always the first pair. Engine thread.
    """
    vocab = int(logprobs.shape[-1])
    k = min(k, vocab)
    if k <= 0:
        return ()
    # NOTE: argpartition refuses k == vocab; then every id is in the answer.
    ids = mx.arange(vocab) if k == vocab else mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:k]
    values = logprobs[ids].astype(mx.float32)
    id_list = cast("list[int]", ids.tolist())
    value_list = cast("list[float]", values.tolist())
    pairs = zip(id_list, value_list, strict=True)
    ranked = sorted(((int(i), float(v)) for i, v in pairs), key=lambda p: (-p[1], p[0]))
    return tuple(ranked)


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character → byte table (the inverse of ``bytes_to_unicode``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


class TokenBytes:
    """The exact bytes each token id stands for, read from the tokenizer's vocabulary.

    Byte-level BPE pieces map back through GPT-2's byte table, SentencePiece
    pieces turn ``▁`` into a space and ``<0xNN>`` into that byte; any other
    tokenizer falls back to decoding the single id. A token that is part of
    a multi-byte character has bytes that are no text on their own, which
    is why OpenAI reports bytes next to each token. Thread-safe (a lock
    around a bounded cache); no MLX.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._hf = hf
        detok = type(getattr(tokenizer, "_detokenizer", None)).__name__
        self._kind = ("bpe" if detok == "BPEStreamingDetokenizer"
                      else "spm" if detok == "SPMStreamingDetokenizer" else "text")
        self._lock = threading.Lock()
        self._cache: dict[int, bytes] = {}
        # NOTE: added tokens (control tokens included) are stored as their text,
        # not through the byte table.
        added = getattr(hf, "added_tokens_decoder", None) or {}
        self._added = frozenset(int(t) for t in added)
        eos = getattr(tokenizer, "eos_token_ids", None) or ()
        self.eos_token_ids: frozenset[int] = frozenset(int(t) for t in eos)
        """Token ids that end a generation (not part of the answer's text)."""

    def __call__(self, token_ids: Iterable[int]) -> list[bytes]:
        """The bytes of each id (an id outside the vocabulary gives ``b""``)."""
        return [self._one(int(t)) for t in token_ids]

    def _one(self, token_id: int) -> bytes:
        with self._lock:
            hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        value = self._spell(token_id)
        with self._lock:
            if len(self._cache) >= 65536:
                self._cache.clear()
            self._cache[token_id] = value
        return value

    def _spell(self, token_id: int) -> bytes:
        piece = self._hf.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if token_id in self._added:
            return piece.encode()
        if self._kind == "bpe":
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        elif self._kind == "spm":
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace("\u2581", " ").encode()
        return str(self._hf.decode([token_id])).encode()
