"""Streaming text of one generation: detokenization plus stop-string hold-back.

Pure Python over mlx-lm's streaming detokenizer (no MLX arrays), so it is
safe anywhere; the generation kernel drives it on the engine thread.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

__all__ = ["StreamingDetokenizer", "TextStream", "untrimmed"]


class StreamingDetokenizer(Protocol):
    """The part of ``mlx_lm.tokenizer_utils.StreamingDetokenizer`` kvtier uses."""

    def reset(self) -> None: ...

    def add_token(self, token: int) -> None: ...

    def finalize(self) -> None: ...

    @property
    def last_segment(self) -> str: ...


class _UntrimmedBPE(BPEStreamingDetokenizer):
    """mlx-lm's BPE detokenizer without the first segment's space trim."""

    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text


def untrimmed(detokenizer: StreamingDetokenizer) -> StreamingDetokenizer:
    """A copy of ``detokenizer`` that keeps the first token's leading space.

    NOTE: mlx-lm's SPM and BPE detokenizers drop a leading space of the first
    segment, which is right for a text that starts at the beginning of a
    document but wrong for a generation that continues a prompt: for
    ``"The capital of France is"`` the first token is ``" Paris"`` and the
    completion text must be ``" Paris"`` so that prompt + text is the prompt
    + tokens (as OpenAI answers). Other detokenizers (mlx-lm's naive one,
    scripted fakes) are returned unchanged.
    """
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        spm = copy.copy(detokenizer)
        spm.trim_space = False
        return spm
    if isinstance(detokenizer, BPEStreamingDetokenizer):
        bpe = copy.copy(detokenizer)
        # NOTE: a shallow copy shares the (read-only) token map; only the
        # trimming rule changes.
        bpe.__class__ = _UntrimmedBPE
        return bpe
    return detokenizer


class TextStream:
    """Turns tokens into releasable text deltas, holding back possible stop-string starts.

    Invariants: the concatenation of every delta returned never contains a
    stop string, and equals the detokenized text cut just before the first
    stop-string occurrence (or all of it when none occurs). Text that could
    still become the start of a stop string is held until a later token
    completes the stop (discarded) or rules it out (released).
    """

    def __init__(self, detokenizer: StreamingDetokenizer, stop: Sequence[str] = ()) -> None:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._detok = untrimmed(detokenizer)
        self._detok.reset()
        self._stop = tuple(stop)
        self._held = ""
        self._stopped_by: str | None = None
        self._finished = False

    @property
    def stopped_by(self) -> str | None:
        """The stop string that ended the text, or ``None``."""
        return self._stopped_by

    @property
    def finished(self) -> bool:
        """True after a stop string matched or :meth:`finish` ran."""
        return self._finished

    @property
    def held(self) -> str:
        """Text withheld because it may begin a stop string."""
        return self._held

    def add(self, token: int) -> str:
        """Feed one token; return the text that can be released now."""
        if self._finished:
            return ""
        self._detok.add_token(token)
        return self._release(self._detok.last_segment)

    def finish(self) -> str:
        """Flush the detokenizer and any held text (no more tokens will come)."""
        if self._finished:
            return ""
        self._detok.finalize()
        out = self._release(self._detok.last_segment)
        # NOTE: after finalize nothing can complete a partial stop match, so
        # held text is released (it is empty when a stop string just matched).
        out += self._held
        self._held = ""
        self._finished = True
        return out

    def _release(self, segment: str) -> str:
        buf = self._held + segment
        if not self._stop:
            self._held = ""
            return buf
        cut = -1
        for s in self._stop:
            i = buf.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
                self._stopped_by = s
        if cut >= 0:
            self._held = ""
            self._finished = True
            return buf[:cut]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
