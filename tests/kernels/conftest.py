"""The kernel tests' shared fixtures: the ASCII tiny tokenizer and tiny fp32 Llamas (a module may define its own)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.kernels.test_generation import lively_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    """The ASCII tiny tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny fp32 Llama with varied greedy output."""
    return lively_llama(len(tok), seed=1)


@pytest.fixture
def unbinding_model(tok: Any) -> Any:
    """A tiny fp32 Llama (seed 3) whose module's attention goes back to mlx-lm's afterwards (tests that bind kvtier's)."""
    from kernels.model import unbind_masked_attention

    m = lively_llama(len(tok), seed=3)
    # NOTE: from mlx-lm's own attention (a model loaded earlier in this process
    # may have bound kvtier's, e.g. the CPU's native softmax).
    unbind_masked_attention(m)
    yield m
    unbind_masked_attention(m)
