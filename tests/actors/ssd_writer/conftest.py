"""Fixtures shared by the SSD writer's tests that run a model on an engine thread."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from kernels import EngineThread
from tests.tiny_models import kv_llama


@pytest.fixture(scope="module")
def model() -> Any:
    """A tiny fp32 Llama."""
    return kv_llama()


@pytest.fixture
async def engine() -> AsyncIterator[EngineThread]:
    """The engine thread for this test."""
    async with EngineThread() as thread:
        yield thread
