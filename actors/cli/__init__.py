"""The ``kvtier`` command line: ``serve``, ``fetch-default-model``, ``replay``."""

from __future__ import annotations

from .main import build_parser, main

__all__ = ["build_parser", "main"]
