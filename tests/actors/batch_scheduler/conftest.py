"""Fixtures shared by the batch lane's tests that run an Engine on a tiny model."""

from __future__ import annotations

from typing import Any

import pytest

from tests.kernels.test_generation import lively_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny byte-level BPE tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny fp32 Llama whose greedy output varies."""
    return lively_llama(len(tok))
