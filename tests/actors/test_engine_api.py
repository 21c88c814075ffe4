"""The public embedding API (``actors.engine.Engine``) on a tiny random-weight Llama."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
from mlx_lm import stream_generate

from actors.engine import (
    ContextTooLong,
    DoneEvent,
    Engine,
    EngineNotStarted,
    GenerationParams,
    GenerationStream,
    InvalidRequest,
    QueueFull,
    ServerShuttingDown,
    TokenEvent,
)
from kernels import encode_prompt, on_engine_thread
from tests.kernels.test_generation import lively_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

PROMPT = "the cat in the hat sat on the mat and then it ran far away"
CHAT = [{"role": "user", "content": "the cat in the hat"}]


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny byte-level BPE tokenizer (with a chat template)."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny fp32 Llama whose greedy output varies."""
    return lively_llama(len(tok))


@pytest.fixture
async def engine(model: Any, tok: Any) -> AsyncIterator[Engine]:
    """A started engine over the tiny model, prompt cache on, queue of one."""
    async with Engine.from_loaded(
        model, tok, model_id="tiny", max_queue=1, prompt_cache_bytes=1 << 26, stream_buffer=4
    ) as eng:
        yield eng


async def _events(stream: GenerationStream) -> list[TokenEvent | DoneEvent]:
    out: list[TokenEvent | DoneEvent] = []
    async with stream:
        async for event in stream:
            out.append(event)
    return out


async def test_chat_streams_tokens_then_one_done_event(engine: Engine) -> None:
    """A chat stream yields indexed TokenEvents then exactly one DoneEvent with matching usage."""
    events = await _events(engine.chat(CHAT, GenerationParams(max_tokens=7)))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert isinstance(events[-1], DoneEvent)
    assert [e.index for e in tokens] == list(range(len(tokens)))
    done = events[-1]
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == len(tokens) == 7
    assert done.usage.prompt_tokens > 5
    assert done.timings.ttft_s > 0


async def test_max_tokens_bounds_the_completion(engine: Engine) -> None:
    """max_tokens=1 and =5 give exactly that many tokens, finish_reason length."""
    for n in (1, 5):
        c = await engine.complete_prompt(PROMPT, GenerationParams(max_tokens=n))
        assert len(c.token_ids) == n
        assert c.finish_reason == "length"


async def test_stop_string_ends_generation_and_is_not_emitted(engine: Engine) -> None:
    """A stop string taken from the greedy output ends the stream with finish_reason stop, text cut before it."""
    full = await engine.complete_prompt(PROMPT, GenerationParams(max_tokens=24))
    text = full.text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip() == text[i : i + 2])
    cut = text[: text.index(stop)]
    stopped = await engine.complete_prompt(PROMPT, GenerationParams(max_tokens=24, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == cut
    assert stop not in stopped.text


async def test_greedy_output_equals_mlx_lm_token_for_token(model: Any, tok: Any) -> None:
    """Greedy tokens through the Engine equal mlx_lm.stream_generate's for the same prompt."""
    prompt = encode_prompt(tok, PROMPT)
    reference = [r.token for r in stream_generate(model, tok, prompt, max_tokens=16)]
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0, prefill_step_size=7) as eng:
        got = await eng.complete_prompt(prompt, GenerationParams(max_tokens=16))
    assert len(set(reference)) > 3
    assert list(got.token_ids[: len(reference)]) == reference


async def test_prompt_cache_hit_reports_cached_tokens_and_same_output(engine: Engine) -> None:
    """A repeated chat reuses the cached prefix (cached_tokens > 0) and gives the same greedy text."""
    first = await engine.complete(CHAT, GenerationParams(max_tokens=6))
    second = await engine.complete(CHAT, GenerationParams(max_tokens=6))
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == second.usage.prompt_tokens - 1
    assert second.text == first.text


async def test_failed_materialize_degrades_to_a_cold_prefill(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache hit whose arrays cannot be materialized is served cold: same text, cached_tokens 0."""
    first = await engine.complete(CHAT, GenerationParams(max_tokens=6))

    def broken(handle: str, n: int) -> Any:
        raise RuntimeError(f"simulated registry failure for {handle}:{n}")

    monkeypatch.setattr(engine.cache_registry, "materialize", broken)
    second = await engine.complete(CHAT, GenerationParams(max_tokens=6))
    assert (await engine.stats())["prompt_cache"]["hits"] >= 1
    assert second.usage.cached_tokens == 0
    assert second.text == first.text


async def test_failed_register_still_completes_the_request(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registry that cannot keep the finished cache costs a future miss, not the answer."""
    reference = await engine.complete(CHAT, GenerationParams(max_tokens=6))

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated registry failure")

    monkeypatch.setattr(engine.cache_registry, "register", broken)
    monkeypatch.setattr(engine.cache_registry, "snapshot", broken)
    other = [{"role": "user", "content": "a different question about the mat"}]
    done = await engine.complete(other, GenerationParams(max_tokens=6))
    assert done.finish_reason in ("length", "stop")
    assert done.usage.completion_tokens >= 1
    again = await engine.complete(CHAT, GenerationParams(max_tokens=6))
    assert again.text == reference.text


async def test_cancel_mid_stream_frees_the_lane_within_one_step(engine: Engine) -> None:
    """Closing a stream mid-generation lets the queued request run; the cancelled one gets at most one more decode turn."""
    long = engine.chat(CHAT, GenerationParams(max_tokens=100_000))
    await long.start()
    seen = 0
    async for event in long:
        assert isinstance(event, TokenEvent)
        seen += 1
        if seen == 3:
            break
    waiting = engine.generate(PROMPT, GenerationParams(max_tokens=4))
    await waiting.start()
    await long.aclose()
    # NOTE: steps run on the engine thread (a burst reports its steps only when it ends).
    decode_at_cancel = (await engine.stats(timeout=30))["gateway"]["decode_steps_run"]
    events = await _events(waiting)
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert done.finish_reason == "length"
    # NOTE: the lane is released when the runner's report reaches the gateway,
    # just after the DoneEvent; give it a few loop iterations.
    for _ in range(500):
        if (await engine.stats())["gateway"]["token"]["lane"] is None:
            break
        await anyio.sleep(0.01)
    token = (await engine.stats())["gateway"]["token"]
    assert token["requests"]["cancelled"] == 1
    extra = (await engine.stats(timeout=30))["gateway"]["decode_steps_run"] - decode_at_cancel - done.usage.completion_tokens
    assert 0 <= extra <= 1
    assert token["grants"]["decode"] == (await engine.stats(timeout=30))["gateway"]["decode_steps_run"]


async def test_queue_overflow_raises_queue_full_before_any_event(engine: Engine) -> None:
    """With one request running and one queued (max_queue=1), a third is refused with QueueFull at admission."""
    running = engine.chat(CHAT, GenerationParams(max_tokens=100_000))
    queued = engine.chat(CHAT, GenerationParams(max_tokens=2))
    await running.start()
    await queued.start()
    overflow = engine.chat(CHAT, GenerationParams(max_tokens=2))
    with pytest.raises(QueueFull):
        await overflow.start()
    assert (await engine.stats())["gateway"]["token"]["requests"]["rejected_queue_full"] == 1
    await running.aclose()
    events = await _events(queued)
    assert isinstance(events[-1], DoneEvent)


async def test_shutdown_refuses_new_requests_and_drains_in_flight(model: Any, tok: Any) -> None:
    """After begin_shutdown new requests raise ServerShuttingDown while the in-flight stream finishes normally."""
    eng = Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0, stream_buffer=2)
    async with eng:
        inflight = eng.chat(CHAT, GenerationParams(max_tokens=12))
        await inflight.start()
        eng.begin_shutdown()
        with pytest.raises(ServerShuttingDown):
            await eng.chat(CHAT, GenerationParams(max_tokens=2)).start()
        events = await _events(inflight)
        assert isinstance(events[-1], DoneEvent)
        assert events[-1].usage.completion_tokens == 12
        await eng.drain()
    assert (await eng.stats())["state"] == "closed"


async def test_background_turn_runs_on_engine_thread_only_when_lane_is_free(engine: Engine) -> None:
    """run_when_idle runs its step on the engine thread, never after the lane holder's first turn while it holds the lane."""
    loop = anyio.lowlevel.current_token()
    received: list[TokenEvent | DoneEvent] = []
    observed: list[tuple[bool, object, object, int]] = []

    def step() -> int:
        # NOTE: asks the gateway (on the loop) from inside the background turn.
        token = anyio.from_thread.run(engine.stats, token=loop)["gateway"]["token"]
        observed.append((on_engine_thread(), token["lane"], token["queued"], len(received)))
        return 42

    stream = engine.chat(CHAT, GenerationParams(max_tokens=30))
    await stream.start()
    results: list[int] = []

    async def background() -> None:
        results.append(await engine.run_when_idle(step, timeout=30))

    async with anyio.create_task_group() as tg:
        tg.start_soon(background)
        async with stream:
            async for event in stream:
                received.append(event)
    assert isinstance(received[-1], DoneEvent)
    assert results == [42]
    [(on_thread, lane, queued, seen)] = observed
    assert on_thread
    assert queued == 0
    # NOTE: a background turn may use the wait for the holder's first turn
    # (its prompt-cache lookup); never the time between its turns.
    assert lane is None or (lane == stream.request_id and seen == 0)
    assert (await engine.stats())["gateway"]["token"]["grants"]["background"] == 1


async def test_invalid_and_unstarted_requests_raise_typed_errors(model: Any, tok: Any) -> None:
    """An empty prompt is InvalidRequest; a request before start is EngineNotStarted."""
    eng = Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0)
    with pytest.raises(EngineNotStarted):
        await eng.generate([1, 2]).start()
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0) as started:
        with pytest.raises(InvalidRequest):
            await started.generate([]).start()
        with pytest.raises(InvalidRequest):
            started.chat([])


async def test_prompt_over_max_prompt_tokens_is_refused_before_admission(model: Any, tok: Any) -> None:
    """A prompt longer than max_prompt_tokens raises ContextTooLong without being admitted; one at the cap runs."""
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0,
                                  max_prompt_tokens=8) as eng:
        with pytest.raises(ContextTooLong, match="max_prompt_tokens is 8") as info:
            await eng.generate(list(range(3, 12)), GenerationParams(max_tokens=2)).start()
        assert (info.value.prompt_tokens, info.value.limit) == (9, 8)
        assert (await eng.stats())["gateway"]["token"]["requests"]["admitted"] == 0
        done = await eng.complete_prompt(list(range(3, 11)), GenerationParams(max_tokens=2))
        assert done.usage.prompt_tokens == 8
        assert done.finish_reason == "length"
        assert (await eng.stats())["gateway"]["token"]["requests"]["admitted"] == 1


async def test_prompt_plus_max_tokens_over_the_context_is_refused(model: Any, tok: Any) -> None:
    """prompt + max_tokens past the model's context is ContextTooLong before admission; fitting exactly runs."""
    prompt = encode_prompt(tok, PROMPT)
    context = len(prompt) + 8
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0,
                                  max_context=context) as eng:
        with pytest.raises(ContextTooLong, match="context") as info:
            await eng.generate(prompt, GenerationParams(max_tokens=9)).start()
        assert (info.value.prompt_tokens, info.value.max_tokens) == (len(prompt), 9)
        assert info.value.limit == context
        assert (await eng.stats())["gateway"]["token"]["requests"]["admitted"] == 0
        done = await eng.complete_prompt(prompt, GenerationParams(max_tokens=8))
        assert len(done.token_ids) == 8
        assert done.usage.prompt_tokens + done.usage.completion_tokens == context



async def test_fit_context_shortens_max_tokens_to_the_room_left(model: Any, tok: Any) -> None:
    """With fit_context, a max_tokens past the context shrinks to the room the prompt leaves."""
    prompt = encode_prompt(tok, PROMPT)
    context = len(prompt) + 5
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0,
                                  max_context=context) as eng:
        done = await eng.complete_prompt(prompt, GenerationParams(max_tokens=64), fit_context=True)
    assert done.usage.completion_tokens <= 5
    assert done.usage.prompt_tokens + done.usage.completion_tokens <= context


async def test_out_of_vocabulary_ids_are_invalid_before_admission(model: Any, tok: Any) -> None:
    """Prompt ids, logit_bias keys or stop ids outside the vocabulary are InvalidRequest, never admitted."""
    vocab = model.args.vocab_size
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0) as eng:
        for prompt, params in [
            ([3, vocab], GenerationParams(max_tokens=2)),
            ([3, 4], GenerationParams(max_tokens=2, logit_bias={vocab + 7: 1.0})),
            ([3, 4], GenerationParams(max_tokens=2, stop_token_ids=(vocab,))),
        ]:
            with pytest.raises(InvalidRequest, match="outside the vocabulary"):
                await eng.generate(prompt, params).start()
        assert (await eng.stats())["gateway"]["token"]["requests"]["admitted"] == 0


async def test_logit_bias_steers_greedy_decoding(model: Any, tok: Any) -> None:
    """A -100 bias on the greedy first token makes greedy decoding pick another one."""
    prompt = encode_prompt(tok, PROMPT)
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0) as eng:
        plain = await eng.complete_prompt(prompt, GenerationParams(max_tokens=1))
        first = plain.token_ids[0]
        biased = await eng.complete_prompt(
            prompt, GenerationParams(max_tokens=1, logit_bias={first: -100.0})
        )
    assert biased.token_ids[0] != first

@pytest.mark.model
async def test_default_model_chat_streams_and_matches_mlx_lm_greedy(default_model_path: Path) -> None:
    """Engine() on the real default model streams a chat whose greedy tokens and text equal mlx_lm's."""
    import kernels

    loaded = kernels.load_model(default_model_path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = kernels.render_chat(loaded.tokenizer, messages)
    # NOTE: mlx_lm's generate() returns the concatenated texts of this same
    # stream; one run gives both references.
    responses = list(stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=24))
    reference = [r.token for r in responses]
    reference_text = "".join(r.text for r in responses)
    eos = set(loaded.tokenizer.eos_token_ids)
    async with Engine(max_queue=2, prompt_cache_bytes=1 << 28) as eng:
        assert eng.identity == loaded.identity
        events = await _events(eng.chat(messages, GenerationParams(max_tokens=24)))
        again = await eng.complete(messages, GenerationParams(max_tokens=24))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    done = events[-1]
    assert isinstance(done, DoneEvent)
    got = [t.token_id for t in tokens if t.token_id not in eos]
    assert got == [t for t in reference if t not in eos]
    assert "".join(t.text for t in tokens) == reference_text
    assert "Paris" in reference_text
    assert again.usage.cached_tokens > 0
    assert again.text == reference_text


async def test_abandoned_stream_is_cancelled_when_collected(engine: Engine) -> None:
    """A started stream dropped without aclose is cancelled on garbage collection, so the next request runs."""
    import gc

    stream = engine.chat(CHAT, GenerationParams(max_tokens=100_000))
    await stream.start()
    assert isinstance(await stream.__anext__(), TokenEvent)
    del stream
    gc.collect()
    with anyio.fail_after(30):
        after = await engine.complete_prompt(PROMPT, GenerationParams(max_tokens=3))
    assert after.finish_reason == "length"
    assert (await engine.stats())["gateway"]["token"]["requests"]["cancelled"] == 1


class _FailingModel:
    """Delegates to a real model but raises ``error`` on its ``fail_at``-th forward (an engine-thread failure)."""

    def __init__(self, inner: Any, fail_at: int, error: BaseException | None = None) -> None:
        self.inner = inner
        self.layers = inner.layers
        self.calls = 0
        self.fail_at = fail_at
        self.error = error if error is not None else RuntimeError("forward exploded")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return self.inner(*args, **kwargs)


async def test_engine_failure_mid_stream_raises_generation_failed_and_frees_lane(model: Any, tok: Any) -> None:
    """A forward that raises on the engine thread surfaces as GenerationFailed and the next request still runs."""
    from actors.engine import GenerationFailed

    failing = _FailingModel(model, fail_at=4)
    async with Engine.from_loaded(failing, tok, model_id="tiny", prompt_cache_bytes=0) as eng:
        got: list[TokenEvent] = []

        async def read_all() -> None:
            async with eng.generate(PROMPT, GenerationParams(max_tokens=10)) as stream:
                async for event in stream:
                    assert isinstance(event, TokenEvent)
                    got.append(event)

        with pytest.raises(GenerationFailed, match="forward exploded"):
            await read_all()
        assert 0 < len(got) < 10
        after = await eng.complete_prompt(PROMPT, GenerationParams(max_tokens=3))
        assert after.finish_reason == "length"
        assert (await eng.stats())["gateway"]["token"]["requests"]["failed"] == 1


CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"
"""What MLX's CUDA backend raised on an H100 when another process held the card's memory."""


async def _read(eng: Engine, got: list[TokenEvent]) -> None:
    async with eng.generate(PROMPT, GenerationParams(max_tokens=10)) as stream:
        async for event in stream:
            assert isinstance(event, TokenEvent)
            got.append(event)


@pytest.mark.parametrize("max_batch", [1, 4], ids=["serial", "batch"])
async def test_a_step_out_of_device_memory_raises_memory_pressure_and_the_next_request_runs(
    model: Any, tok: Any, max_batch: int
) -> None:
    """Either lane: the request whose step failed to allocate gets ``MemoryPressure`` naming the device's error; the next runs."""
    from actors.errors import MemoryPressure

    failing = _FailingModel(model, fail_at=4, error=RuntimeError(CUDA_OOM))
    async with Engine.from_loaded(failing, tok, model_id="tiny", prompt_cache_bytes=0,
                                  max_batch=max_batch) as eng:
        got: list[TokenEvent] = []
        with pytest.raises(MemoryPressure, match=r"ran out of memory.*cudaMallocAsync"):
            await _read(eng, got)
        assert len(got) < 10
        after = await eng.complete_prompt(PROMPT, GenerationParams(max_tokens=3))
        assert after.finish_reason == "length"


async def test_a_batch_step_that_fails_otherwise_stays_a_generation_failure(model: Any, tok: Any) -> None:
    """The batch lane's step raising for another reason is still ``GenerationFailed`` (500), not memory pressure."""
    from actors.engine import GenerationFailed

    async with Engine.from_loaded(_FailingModel(model, fail_at=4), tok, model_id="tiny",
                                  prompt_cache_bytes=0, max_batch=4) as eng:
        with pytest.raises(GenerationFailed, match="forward exploded"):
            await _read(eng, [])


async def test_through_http_a_step_out_of_memory_is_503_memory_pressure_and_a_stream_ends_with_that_code(
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


# NOTE: slow: tests/e2e/test_embed_exit.py runs the same example (tiny model,
# as a process) in the default suite with the same two checks.
@pytest.mark.slow
@pytest.mark.model
def test_docs_embedding_example_runs(default_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/examples/embed.py runs as documented: it streams an answer and its follow-up reuses the prompt cache."""
    import runpy

    example = Path(__file__).resolve().parents[2] / "docs" / "examples" / "embed.py"
    runpy.run_path(str(example), run_name="__main__")
    out = capsys.readouterr().out
    assert "[length]" in out or "[stop]" in out
    cached = next(line for line in out.splitlines() if line.startswith("cached prompt tokens:"))
    assert int(cached.split()[3]) > 0


async def test_requests_without_params_take_the_config_defaults(model: Any, tok: Any) -> None:
    """A request that passes no GenerationParams runs with the engine config's max_tokens."""
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0, max_tokens=3) as eng:
        done = await eng.complete_prompt(PROMPT)
        assert eng.config.default_params().max_tokens == 3
    assert (len(done.token_ids), done.finish_reason) == (3, "length")


async def test_engine_spawns_the_wired_actors_and_asks_their_stats(engine: Engine) -> None:
    """Without a cold tier or batching the engine runs exactly the request path's actors of the
    wiring and the memory actor (relief with the RAM tier), in table order, and /stats sections
    come from their answers."""
    from actors.engine import wiring

    assert engine.system is not None
    request_path = {wiring.PROMPT_CACHE, wiring.GATEWAY, wiring.RUNNER, wiring.MEMORY}
    expected = tuple(spec.name for spec in wiring.ACTORS if spec.name in request_path)
    assert engine.system.actors() == expected
    stats = await engine.stats()
    assert "unavailable" not in stats
    assert stats["gateway"]["admitted_requests"] == 0
    assert stats["gateway"]["live_requests"] == 0
    assert stats["prompt_cache"]["entries"] == 0
