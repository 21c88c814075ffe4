"""Fixtures shared by the whole suite."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """Run anyio tests on asyncio only (the server's loop)."""
    return "asyncio"
