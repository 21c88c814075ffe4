"""The id of the request being served, kept in its ASGI scope."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["REQUEST_ID_KEY", "RequestId", "request_id_of"]


@dataclass
class RequestId:
    """The id of the request being served: ``req-<hex>``, renamed by a generation route."""

    hex: str
    value: str


REQUEST_ID_KEY = "kvtier.request_id"
"""Scope key of the request's :class:`RequestId` (set by the access log, the outermost layer)."""


def request_id_of(scope: Mapping[str, Any]) -> str | None:
    """The id the response's ``X-Request-Id`` carries, or ``None`` outside the app."""
    rid = scope.get(REQUEST_ID_KEY)
    return rid.value if isinstance(rid, RequestId) else None
