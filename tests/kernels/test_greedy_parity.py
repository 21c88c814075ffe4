"""Greedy parity of the generation kernel with mlx-lm on the real default model."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import generate, stream_generate
from mlx_lm.models.cache import make_prompt_cache

from kernels import (
    EngineThread,
    Generation,
    LoadedModel,
    SamplingParams,
    StepOutput,
    load_model,
    render_chat,
    run_generation,
)

pytestmark = pytest.mark.model

MAX_TOKENS = 16
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def loaded(default_model_path: Path) -> LoadedModel:
    """The default model loaded once for this module."""
    return load_model(default_model_path)


def _mlx_lm_tokens(lm: LoadedModel, prompt: list[int]) -> list[int]:
    return [r.token for r in stream_generate(lm.model, lm.tokenizer, prompt, max_tokens=MAX_TOKENS)]


def test_kernel_greedy_equals_mlx_lm_generate(loaded: LoadedModel) -> None:
    """Greedy tokens and text through the kernel equal mlx_lm's on the default model."""
    prompt = render_chat(loaded.tokenizer, MESSAGES)
    steps = run_generation(Generation(loaded.model, loaded.tokenizer, prompt, SamplingParams(max_tokens=MAX_TOKENS), prefill_step_size=8))
    ours = [s.token_id for s in steps]
    assert ours == _mlx_lm_tokens(loaded, prompt)
    text = generate(loaded.model, loaded.tokenizer, prompt, max_tokens=MAX_TOKENS)
    assert "".join(s.text for s in steps) == text
    assert len(text) > 0


# NOTE: slow (11 s): tests/actors/test_engine_api.py's default-model chat
# drives the same engine thread to mlx-lm's greedy tokens in the default suite.
@pytest.mark.slow
@pytest.mark.anyio
async def test_stepping_through_engine_thread_equals_mlx_lm(loaded: LoadedModel) -> None:
    """Driving prefill and decode one turn at a time through EngineThread.run gives mlx_lm's tokens."""
    prompt = render_chat(loaded.tokenizer, [{"role": "user", "content": "What is 2 + 2?"}])
    expected = _mlx_lm_tokens(loaded, prompt)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    async with EngineThread() as engine:
        gen: Generation = await engine.run(
            partial(Generation, prefill_step_size=8), loaded.model, loaded.tokenizer, prompt, params
        )
        while not await engine.run(gen.prefill_step):
            pass
        steps: list[StepOutput] = []
        while gen.finish_reason is None:
            steps.append(await engine.run(gen.decode_step))
    assert [s.token_id for s in steps] == expected


def test_reused_prefix_equals_cold_on_default_model(loaded: LoadedModel) -> None:
    """On the fp32 default model, a cache covering the chat prefix gives the cold greedy tokens."""
    prompt = render_chat(loaded.tokenizer, MESSAGES)
    cold = [s.token_id for s in run_generation(Generation(loaded.model, loaded.tokenizer, prompt, SamplingParams(max_tokens=8)))]
    k = len(prompt) - 3
    cache: list[Any] = make_prompt_cache(loaded.model)
    loaded.model(mx.array(prompt[:k])[None], cache=cache)
    mx.eval([c.state for c in cache])
    gen = Generation(loaded.model, loaded.tokenizer, prompt, SamplingParams(max_tokens=8), cache=cache, cached_tokens=k)
    assert [s.token_id for s in run_generation(gen)] == cold
