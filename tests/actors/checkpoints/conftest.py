"""Fixtures shared by the generation-checkpoint tests that run an Engine on a tiny model."""

from __future__ import annotations

from typing import Any

import pytest

from tests.tiny_models import kv_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def model() -> Any:
    """One tiny fp32 Llama for the module (the same weights in every Engine)."""
    return kv_llama(vocab_size=len(tiny_tokenizer()))
