"""Fixtures shared by the whole suite."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from actors.runtime import set_tracing
from actors.runtime._tracing import KVTIER_HANDLER

# NOTE: the real-model fixtures (default_model_path, ...) for every test module,
# without per-module imports that linters read as unused or redefined names.
pytest_plugins = ["tests.model_fixtures"]


@pytest.fixture
def anyio_backend() -> str:
    """Run anyio tests on asyncio only (the server's loop)."""
    return "asyncio"


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    """Undo ``configure_logging`` (and any bound context) after the test."""
    try:
        yield
    finally:
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
        set_tracing(False)
        root = logging.getLogger()
        for handler in [h for h in root.handlers if getattr(h, KVTIER_HANDLER, False)]:
            root.removeHandler(handler)
        root.setLevel(logging.WARNING)

