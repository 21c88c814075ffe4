"""A step that runs out of device memory answers memory pressure (503, retryable), not a generation failure (500)."""

from __future__ import annotations

from typing import Any

import pytest

from actors.engine import Engine, GenerationFailed
from actors.errors import MemoryPressure
from kernels import device_out_of_memory
from messages.gateway import GenerationParams, TokenEvent
from tests.kernels.test_generation import lively_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

PROMPT = [5, 6, 7, 8, 9]
CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"
"""What MLX's CUDA backend raised on an H100 when another process held the card's memory."""
METAL_OOM = ("[METAL] Command buffer execution failed: Insufficient Memory "
             "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)")


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny byte-level BPE tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny fp32 Llama."""
    return lively_llama(len(tok))


class _FailingModel:
    """Delegates to a real model but raises ``error`` on its ``fail_at``-th forward."""

    def __init__(self, inner: Any, fail_at: int, error: BaseException) -> None:
        self.inner = inner
        self.layers = inner.layers
        self.args = inner.args
        self.calls = 0
        self.fail_at = fail_at
        self.error = error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _read(eng: Engine, got: list[TokenEvent]) -> None:
    async with eng.generate(PROMPT, GenerationParams(max_tokens=10)) as stream:
        async for event in stream:
            assert isinstance(event, TokenEvent)
            got.append(event)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (CUDA_OOM, True),
        ("[malloc] Unable to allocate 17179869184 bytes.", True),
        (METAL_OOM, True),
        ("forward exploded", False),
        ("[matmul] Last dimension of first input with shape (1,4) must match", False),
    ],
)
def test_the_out_of_memory_texts_of_mlxs_backends_are_told_apart(text: str, expected: bool) -> None:
    """CUDA's, the allocator's and Metal's allocation failures are out of memory; a shape error is not."""
    assert device_out_of_memory(RuntimeError(text)) is expected
    assert device_out_of_memory(MemoryError()) is True
    assert device_out_of_memory(ValueError("out of memory")) is False


@pytest.mark.parametrize("max_batch", [1, 4], ids=["serial", "batch"])
async def test_a_step_out_of_device_memory_raises_memory_pressure_and_the_next_request_runs(
    model: Any, tok: Any, max_batch: int
) -> None:
    """Either lane: the request whose step failed to allocate gets ``MemoryPressure`` naming the device's error; the next runs."""
    failing = _FailingModel(model, fail_at=4, error=RuntimeError(CUDA_OOM))
    async with Engine.from_loaded(failing, tok, model_id="tiny", prompt_cache_bytes=0,
                                  max_batch=max_batch) as eng:
        got: list[TokenEvent] = []
        with pytest.raises(MemoryPressure, match=r"ran out of memory.*cudaMallocAsync"):
            await _read(eng, got)
        assert len(got) < 10
        after = await eng.complete_prompt(PROMPT, GenerationParams(max_tokens=3))
        assert after.finish_reason == "length"


@pytest.mark.parametrize("max_batch", [1, 4], ids=["serial", "batch"])
async def test_any_other_step_failure_stays_a_generation_failure(model: Any, tok: Any, max_batch: int) -> None:
    """A step that raises for another reason is still ``GenerationFailed`` (500), not memory pressure."""
    failing = _FailingModel(model, fail_at=4, error=RuntimeError("forward exploded"))
    async with Engine.from_loaded(failing, tok, model_id="tiny", prompt_cache_bytes=0,
                                  max_batch=max_batch) as eng:
        with pytest.raises(GenerationFailed, match="forward exploded"):
            await _read(eng, [])


async def test_through_http_the_answer_is_503_memory_pressure_and_a_stream_ends_with_that_code(
    model: Any, tok: Any
) -> None:
    """Through the HTTP app (batch lane): a plain completion whose step ran out of memory is a 503
    ``memory_pressure`` OpenAI error, a streamed one ends with that error event; then the server answers."""
    import httpx

    from actors.http import HttpSettings, create_app

    failing = _FailingModel(model, fail_at=3, error=RuntimeError(CUDA_OOM))
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    async with Engine.from_loaded(failing, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=4) as eng:
        app = create_app(eng, HttpSettings())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            plain = await c.post("/v1/completions", json=body)
            failing.fail_at = failing.calls + 3
            streamed = await c.post("/v1/completions", json={**body, "stream": True})
            after = await c.post("/v1/completions", json=body)
    assert plain.status_code == 503
    assert plain.json()["error"]["code"] == "memory_pressure"
    assert "out of memory" in plain.json()["error"]["message"]
    events = [line[5:].strip() for line in streamed.text.splitlines() if line.startswith("data:")]
    assert '"memory_pressure"' in events[-1]
    assert after.status_code == 200
