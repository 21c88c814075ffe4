"""Stable block identity: seedless chained SHA-256 block hashes over token ids.

A tier entry covering ``N`` tokens is the chain of its ``N // BLOCK_SIZE``
full blocks (a trailing partial block is not announced, as in vLLM, whose
default block size is also 16 tokens). Block ``i``'s digest is

    SHA-256(digest of block i-1 || the block's 16 token ids, 4 bytes big-endian each)

with the namespace root standing in for block -1:

    SHA-256("kvtier.block-root.v1" NUL || len-prefixed model fingerprint
            || len-prefixed KV scheme || len-prefixed cache namespace)

The cache namespace is the prompt cache's (``messages.prompt_cache.cache_namespace``:
adapter, plus a digest of ``cache_salt`` and the API-key scope when set),
so a salted prompt never shares a block hash with an unsalted one.

NOTE: seedless on purpose (vLLM seeds its root from ``PYTHONHASHSEED`` or a
random value): equal tokens under equal (model, scheme, namespace) give
equal hashes in every process, after every restart, on every replica, so a
router can compare replicas' announcements and a restarted server's disk
tier reappears under the same hashes. The published hash
(:func:`external_hash`) is the digest's last 8 bytes as an unsigned
big-endian integer, vLLM's ``ExternalBlockHash`` convention.

Pure Python (hashlib, struct): importable without MLX, msgspec or ZeroMQ.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = [
    "BLOCK_SIZE",
    "HASH_SCHEME",
    "block_digests",
    "external_hash",
    "namespace_root",
]

BLOCK_SIZE = 16
"""Tokens per block (vLLM's default block size)."""

HASH_SCHEME = "kvtier-sha256-chain-v1"
"""The name of this hash definition (announced by ``/get_server_info``)."""

_ROOT_DOMAIN = b"kvtier.block-root.v1\x00"
_MAX_TOKEN = 1 << 32


def _part(value: str) -> bytes:
    raw = value.encode("utf-8")
    return len(raw).to_bytes(4, "big") + raw


def namespace_root(*, model: str, kv_scheme: str, namespace: str) -> bytes:
    """The 32-byte root digest of one (model fingerprint, KV scheme, cache namespace).

    NOTE: every field is length-prefixed, so no two different triples give
    the same digest input.
    """
    return hashlib.sha256(_ROOT_DOMAIN + _part(model) + _part(kv_scheme) + _part(namespace)).digest()


def block_digests(
    root: bytes, tokens: Sequence[int], *, block_size: int = BLOCK_SIZE, start: int = 0
) -> list[bytes]:
    """The chained digests of the full blocks of ``tokens`` (one 32-byte digest per block).

    ``start`` skips the first ``start`` blocks' digests in the result (they
    are still chained through). Raises ``ValueError`` for a token id outside
    ``[0, 2**32)`` or a ``block_size`` below 1.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    full = len(tokens) // block_size
    if full == 0:
        return []
    n = full * block_size
    head = tokens[:n]
    if min(head) < 0 or max(head) >= _MAX_TOKEN:
        raise ValueError("token ids must lie in [0, 2**32)")
    raw = struct.pack(f">{n}I", *head)
    width = 4 * block_size
    out: list[bytes] = []
    parent = root
    sha = hashlib.sha256
    for i in range(full):
        parent = sha(parent + raw[i * width : (i + 1) * width]).digest()
        if i >= start:
            out.append(parent)
    return out


def external_hash(digest: bytes) -> int:
    """The published block hash: the digest's last 8 bytes, unsigned big-endian (vLLM's convention)."""
    return int.from_bytes(digest[-8:], "big")
