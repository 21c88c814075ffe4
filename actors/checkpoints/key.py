"""The request key of a generation checkpoint: which later request may resume it.

A checkpoint may only be resumed by a request that would produce the same
tokens from the same state. The key is a 128-bit blake2b digest over:

- the rendered prompt's token ids (what the model saw, after the chat
  template and the special-token escaping);
- every field of :class:`messages.GenerationParams` whose value differs from
  its default (sampling, seed, penalties, logit bias, stop strings and ids,
  ``max_tokens``, ``cache_salt``/``cache_scope``, ...): a new field added
  with a default keeps existing keys, and any non-default value of it
  changes the key, so a field nobody thought of is still covered;
- the request's cache namespace (adapter, salt or API-key scope);
- the tier fingerprint, which covers the model identity (config, weights,
  tokenizer, dtype, quantization), the KV scheme's ``cache_key``, the
  runtime (MLX version, device) and the codec's format version.

NOTE: hashing only non-default fields means a change of a field's DEFAULT
value would leave keys unchanged while changing output. ``KEY_VERSION``
must be raised then; ``tests/actors/checkpoints/test_key.py`` pins the
defaults so such a change fails a test that says so.

Pure Python, no MLX: safe on the event loop and on the engine thread.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Final

from messages.gateway import GenerationParams

__all__ = ["KEY_VERSION", "checkpoint_refusal", "request_key"]

KEY_VERSION: Final = 1
"""Raised when the key's inputs or encoding change (or a GenerationParams default does)."""

_PERSON: Final = b"kvtier-ckpt-key"
_DEFAULTS: Final[dict[str, Any]] = GenerationParams().model_dump(mode="json")

_U32: Final = next(code for code in ("I", "L") if array(code).itemsize == 4)
"""The ``array`` type code of an unsigned 32-bit integer here."""


def _params_json(params: GenerationParams) -> str:
    """Canonical JSON of the fields that differ from their defaults (sorted keys, no spaces)."""
    dumped = params.model_dump(mode="json")
    changed = {k: v for k, v in dumped.items() if v != _DEFAULTS.get(k, object())}
    if isinstance(changed.get("logit_bias"), dict):
        # NOTE: token ids as JSON keys are strings; sort them as numbers so
        # {"10": .., "9": ..} and {"9": .., "10": ..} encode alike.
        bias = changed["logit_bias"]
        changed["logit_bias"] = [[int(k), bias[k]] for k in sorted(bias, key=int)]
    return json.dumps(changed, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def request_key(
    prompt_tokens: Sequence[int],
    params: GenerationParams,
    *,
    namespace: str,
    fingerprint: str,
) -> str:
    """The 32-hex-digit key of a request: equal keys mean the same answer from the same state.

    ``fingerprint`` must cover the model and the KV scheme (the cold tier's
    directory fingerprint does). Token ids must lie in ``[0, 2**32)``.
    """
    head = json.dumps(
        {"v": KEY_VERSION, "fingerprint": fingerprint, "namespace": namespace,
         "prompt_len": len(prompt_tokens)},
        sort_keys=True, separators=(",", ":"), ensure_ascii=True,
    )
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for part in (head, _params_json(params)):
        data = part.encode("ascii")
        # NOTE: length-prefixed parts: no two different inputs concatenate alike.
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    # NOTE: packed in C (a 5,000-token prompt: 40 us against 640 for a
    # Python pass and struct.pack, on the event loop, per request); the
    # array refuses an id outside [0, 2**32) with OverflowError.
    try:
        ids = array(_U32, prompt_tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError("token ids must lie in [0, 2**32)") from exc
    if sys.byteorder != "little":
        ids.byteswap()
    h.update(ids.tobytes())
    return h.hexdigest()


def checkpoint_refusal(params: GenerationParams) -> str | None:
    """Why a request is not checkpointed in v1 (``None``: it is eligible).

    Grammar-constrained requests (JSON schemas, forced tool calls) carry the
    grammar matcher's state, and log-probability requests carry response data
    of the saved tokens, neither of which token replay reconstructs.
    """
    if params.grammar is not None:
        return "grammar"
    if params.logprobs or params.top_logprobs or params.prompt_logprobs is not None:
        return "logprobs"
    return None
