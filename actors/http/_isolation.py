"""The prompt-cache scope of an HTTP request under ``--cache-namespace api-key``.

With ``api-key`` every bearer token gets its own prompt-cache namespace: the
scope is a digest of the token (never the token: the scope travels in traced
messages and, folded into the namespace digest, into SSD file headers). A
request without a bearer token has no scope (the shared namespace, or its
``cache_salt``'s). docs/operations.md, "Cache isolation", states the rule.
"""

from __future__ import annotations

import hashlib
from typing import Literal

__all__ = ["CacheNamespaceMode", "request_cache_scope"]

CacheNamespaceMode = Literal["shared", "api-key"]
"""``shared``: only ``cache_salt`` separates clients; ``api-key``: each bearer token does too."""

_DOMAIN = b"kvtier.api-key-scope.v1\x00"


def request_cache_scope(mode: CacheNamespaceMode, authorization: str | None) -> str | None:
    """The ``cache_scope`` of a request with this ``Authorization`` header value under ``mode``.

    ``None`` in ``shared`` mode and for a request without a bearer token.
    The scheme is matched without case (as the API-key check does) and the
    token is stripped, so one key always gives one scope.
    """
    if mode == "shared" or not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    digest = hashlib.sha256(_DOMAIN + token.encode("utf-8", "surrogateescape")).hexdigest()
    return f"api-key:{digest[:32]}"
