"""Typed message bodies exchanged by kvtier's actors (data only, no behaviour)."""

from __future__ import annotations

from ._base import Body, Request

__all__ = ["Body", "Request"]
