"""Log-probabilities of generated and prompt tokens: the most likely alternatives, and tokens as bytes.

:func:`top_logprobs` runs on the engine thread, over the very
log-probabilities the sampler drew from (after logit bias, penalties and a
grammar's mask; before temperature and the top-p/k filters, as mlx-lm
reports them). :class:`PromptScorer` scores a prompt's tokens from the
prefill's own forwards (the model's raw log-softmax, as an evaluation
harness reads it). :class:`TokenBytes` is tokenizer work only (no MLX): the
HTTP edge uses it to spell each reported token.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any, cast

import mlx.core as mx

from messages.gateway import PromptLogprobs

__all__ = [
    "MAX_PROMPT_LOGPROB_ENTRIES",
    "SCORE_ELEMENTS",
    "PromptScorer",
    "TokenBytes",
    "prompt_logprob_entries",
    "score_rows",
    "top_logprobs",
]

MAX_PROMPT_LOGPROB_ENTRIES = 1 << 16
"""Most numbers one request's prompt scores may hold: prompt tokens x (1 + alternatives).

NOTE: the scores travel to the HTTP edge and become one JSON answer; the
bound keeps both (and the memory guard's term for them) small. Past it the
request is refused (400) before admission.
"""

SCORE_ELEMENTS = 1 << 23
"""Most logits one scoring forward materialises (rows x vocabulary).

NOTE: a prefill forward never evaluates its logits; a scoring one does, so
its chunk is cut to ``SCORE_ELEMENTS // vocab`` rows: the float32
log-softmax of a chunk stays under ``4 * SCORE_ELEMENTS`` bytes whatever
``prefill_step_size`` is.
"""


def prompt_logprob_entries(prompt_tokens: int, top: int) -> int:
    """How many numbers scoring a prompt of ``prompt_tokens`` with ``top`` alternatives reports."""
    return max(prompt_tokens, 0) * (1 + max(top, 0))


def score_rows(vocab: int) -> int:
    """Rows of one scoring forward for a vocabulary of ``vocab`` (at least 1)."""
    return max(1, SCORE_ELEMENTS // max(vocab, 1))


def top_logprobs(logprobs: mx.array, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely ``(token_id, logprob)`` pairs of a ``(vocab,)`` row, most likely first.

    Ties are ordered by token id, the order ``argmax`` breaks them in, so at
    temperature 0 the sampled token is always the first pair. Engine thread.
    """
    vocab = int(logprobs.shape[-1])
    k = min(k, vocab)
    if k <= 0:
        return ()
    ids = _top_ids(logprobs[None], k)[0]
    values = logprobs[ids].astype(mx.float32)
    id_list = cast("list[int]", ids.tolist())
    value_list = cast("list[float]", values.tolist())
    pairs = zip(id_list, value_list, strict=True)
    ranked = sorted(((int(i), float(v)) for i, v in pairs), key=lambda p: (-p[1], p[0]))
    return tuple(ranked)


def _top_ids(rows: mx.array, k: int) -> mx.array:
    """The ids of the ``k`` largest values of each row of ``(n, vocab)`` (``0 < k <= vocab``), unordered.

    NOTE: argpartition refuses ``k == vocab``; then every id is in the
    answer. ``k == 1`` (what evaluation harnesses ask: ``logprobs: 1``) is an
    argmax, ~10x cheaper than a partition on the CPU (49k-token rows: 7 vs
    73 ms for 170 rows); it returns the lowest id among equal values, the
    one the callers' (-value, id) order puts first.
    """
    if k == int(rows.shape[-1]):
        return mx.broadcast_to(mx.arange(k), rows.shape)
    if k == 1:
        return mx.argmax(rows, axis=-1, keepdims=True)
    return mx.argpartition(-rows, kth=k - 1, axis=-1)[:, :k]


class PromptScorer:
    """Collects a prompt's scores chunk by chunk, from the prefill's forwards (engine thread).

    :meth:`add` takes one forward's logits ``(rows, vocab)`` over prompt
    positions ``start .. start + rows - 1``; row ``j`` scores the prompt token
    at ``start + j + 1``. The log-softmax is float32 over the raw logits.
    :meth:`result` is the whole prompt's :class:`PromptLogprobs` once every
    token but the first is scored.
    """

    def __init__(self, prompt: Sequence[int], top: int) -> None:
        self._prompt = tuple(int(t) for t in prompt)
        self._top = top
        self._logprobs: list[float] = []
        self._top_ids: list[int] = []
        self._top_values: list[float] = []

    @property
    def scored(self) -> int:
        """Prompt tokens scored so far (the first token is never scored)."""
        return len(self._logprobs)

    def add(self, logits: mx.array, start: int) -> None:
        """Score the prompt tokens that ``logits`` (rows from position ``start``) predict."""
        if start != self.scored:
            raise ValueError(f"scores must arrive in order: expected position {self.scored}, got {start}")
        rows = int(logits.shape[0])
        targets = self._prompt[start + 1 : start + 1 + rows]
        if len(targets) < rows:
            logits = logits[: len(targets)]
        if not targets:
            return
        lp = logits.astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, mx.array(targets)[:, None], axis=-1)[:, 0]
        k = min(self._top, int(lp.shape[-1]))
        # NOTE: a vocabulary smaller than the alternatives asked for reports them all.
        self._top = k
        if k > 0:
            ids = _top_ids(lp, k)
            values = mx.take_along_axis(lp, ids, axis=-1)
            mx.eval(chosen, ids, values)
            id_rows = cast("list[list[int]]", ids.tolist())
            value_rows = cast("list[list[float]]", values.tolist())
            for id_row, value_row in zip(id_rows, value_rows, strict=True):
                ranked = sorted(zip(id_row, value_row, strict=True), key=lambda p: (-p[1], p[0]))
                self._top_ids.extend(int(i) for i, _ in ranked)
                self._top_values.extend(float(v) for _, v in ranked)
        else:
            mx.eval(chosen)
        self._logprobs.extend(float(v) for v in cast("list[float]", chosen.tolist()))

    def result(self) -> PromptLogprobs:
        """The prompt's scores (every token after the first must have been scored)."""
        return PromptLogprobs(token_ids=self._prompt, logprobs=tuple(self._logprobs),
                              top=self._top, top_ids=tuple(self._top_ids),
                              top_logprobs=tuple(self._top_values))


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
