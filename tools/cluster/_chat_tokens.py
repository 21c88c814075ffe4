"""The event router's tokenizer front: chat requests to kvtier's token ids, every piece cached.

The router hashes each request into its block chain, so it needs the token
ids kvtier prefills (``kernels.render_chat``: the chat template, then the
rendered text encoded). An agent's call repeats its whole conversation plus
one tool result; ``render_chat`` re-encodes every piece of it shorter than
the kernels' piece-cache floor (256 characters: short tool results, tool
calls, the role headers), about 37 tokenizer calls on the tenth call of the
benchmark's agent trace, 4-10 ms of Python under the GIL on an idle core and
10-24 ms p50 on the shared 2-core benchmark box. That time delayed both the
request and the streamed answers the router relays meanwhile.

:class:`ChatTokens` renders the template the same way and encodes the text
split at the tokenizer's special tokens, like the kernels' piece encoder,
but keeps every piece (an LRU capped by characters), so a conversation's
next call encodes only what it added: the previous reply and the new tool
result. The split is exact only where the kernels' own check says so
(checked once on a probe text, as the kernels' piece encoder checks) and only when no message spells a
special token (``render_chat`` escapes those); otherwise it calls
``render_chat`` itself, so the ids are always ``render_chat``'s.

Pure tokenizer work (no MLX); one thread at a time (the router's one
tokenizer thread).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatTokens"]


def _specials(tokenizer: Any) -> dict[str, int]:
    """Spelling -> id of the tokenizer's special added tokens (what the template's control tokens are)."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(added, Mapping):
        return {}
    return {str(t.content): int(i) for i, t in added.items()
            if getattr(t, "special", False) and str(getattr(t, "content", ""))}


class ChatTokens:
    """Token ids of chat requests exactly as ``kernels.render_chat`` gives them, pieces cached."""

    def __init__(self, tokenizer: Any, *, max_chars: int = 8 * 1024 * 1024) -> None:
        self.tokenizer = tokenizer
        self._max_chars = max_chars
        self._ids = _specials(tokenizer)
        self._pattern = (re.compile("|".join(re.escape(t) for t in sorted(self._ids, key=len,
                                                                            reverse=True)))
                         if self._ids else None)
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self.encoded = 0
        """Pieces the tokenizer encoded (cache misses)."""
        self.reused = 0
        """Pieces taken from the cache."""
        # NOTE: as the kernels' piece encoder does, checked once: encoding the
        # pieces between special tokens must give the whole text's ids (an
        # added token that strips its neighbours' spaces breaks it); without
        # that every request goes through render_chat.
        self.exact = self._pattern is not None and self._split_is_exact()
        self.fallbacks = 0
        """Requests handed to ``render_chat`` (a special spelling in a message, or no exact split)."""

    def chat(self, messages: Sequence[Mapping[str, Any]],
             tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """``render_chat(tokenizer, messages, tools=tools)``, encoding only pieces not seen before."""
        if not self.exact or self._spells_special(messages, tools):
            from kernels import render_chat

            self.fallbacks += 1
            return render_chat(self.tokenizer, messages, tools=tools)
        kwargs: dict[str, Any] = {}
        if tools is not None:
            kwargs["tools"] = [dict(t) for t in tools]
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False, **kwargs)
        return self.encode(str(text))

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered ``text``: special tokens by id, the pieces between them cached."""
        assert self._pattern is not None
        ids: list[int] = []
        pos = 0
        for match in self._pattern.finditer(text):
            if match.start() > pos:
                ids += self._piece(text[pos:match.start()])
            ids.append(self._ids[match.group(0)])
            pos = match.end()
        if pos < len(text):
            ids += self._piece(text[pos:])
        return ids

    def _piece(self, piece: str) -> tuple[int, ...]:
        cached = self._pieces.get(piece)
        if cached is not None:
            self._pieces.move_to_end(piece)
            self.reused += 1
            return cached
        ids = tuple(int(t) for t in self.tokenizer.encode(piece, add_special_tokens=False))
        self.encoded += 1
        if len(piece) <= self._max_chars:
            self._pieces[piece] = ids
            self._chars += len(piece)
            while self._chars > self._max_chars:
                old, _ = self._pieces.popitem(last=False)
                self._chars -= len(old)
        return ids

    def _split_is_exact(self) -> bool:
        body = "Hello, world!  Two  spaces\nnew line\t tab. " * 3
        probe = "".join(f"{body}{s}\n{body}{s}{s} x{s}" for s in self._ids) + body
        whole = [int(t) for t in self.tokenizer.encode(probe, add_special_tokens=False)]
        try:
            return self.encode(probe) == whole
        finally:
            self._pieces.clear()
            self._chars = 0
            self.encoded = self.reused = 0

    def _spells_special(self, messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None) -> bool:
        """Whether a message (its role aside, as render_chat escapes) or a tool spells a special."""
        return any(self._spells(v) for m in messages for k, v in m.items() if k != "role") or \
            self._spells(tools)

    def _spells(self, value: Any) -> bool:
        assert self._pattern is not None
        if isinstance(value, str):
            return self._pattern.search(value) is not None
        if isinstance(value, Mapping):
            return any(self._spells(v) for v in value.values())
        if isinstance(value, list | tuple):
            return any(self._spells(v) for v in value)
        return False
