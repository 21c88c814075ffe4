"""Batch step chains end to end: ``Engine(max_batch=N)`` on a tiny fp32 Llama, real engine thread and actors.

``BatchEngine.step`` is wrapped to log every batch step (who joined, who was
cancelled, who got a token) and to take at least 2 ms, so "within one step"
is measured in engine steps, not guessed from timing.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from actors.batch_scheduler import actor as actor_module
from actors.batch_scheduler.chain import run_chain
from actors.batch_scheduler.core import JoinRow, StepOut
from actors.batch_scheduler.engine import BatchEngine
from actors.engine import Engine, GenerationParams, TokenEvent
from tests.engine_runs import collect

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class Logged:
    """One batch step as the engine thread ran it."""

    joins: tuple[str, ...]
    cancels: tuple[str, ...]
    tokens: tuple[str, ...]


class StepLog:
    """Every batch step run so far; ``started`` is read from the loop (one int, atomic)."""

    def __init__(self) -> None:
        self.started = 0
        self.steps: list[Logged] = []

    def index_of_join(self, rid: str) -> int:
        """1-based number of the step that joined ``rid``."""
        return next(i for i, s in enumerate(self.steps, 1) if rid in s.joins)

    def index_of_cancel(self, rid: str) -> int:
        """1-based number of the step whose job removed ``rid``."""
        return next(i for i, s in enumerate(self.steps, 1) if rid in s.cancels)


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> StepLog:
    """Log every ``BatchEngine.step`` (and make each take at least 2 ms)."""
    log = StepLog()
    real = BatchEngine.step

    def step(self: BatchEngine, joins: Sequence[JoinRow], cancels: Sequence[str]) -> StepOut:
        log.started += 1
        began = time.perf_counter()
        out = real(self, joins, cancels)
        time.sleep(max(0.0, 0.002 - (time.perf_counter() - began)))
        log.steps.append(
            Logged(
                tuple(j.request.request_id for j in joins),
                tuple(cancels),
                tuple(t.request_id for t in out.tokens),
            )
        )
        return out

    monkeypatch.setattr(BatchEngine, "step", step)
    return log


def _prompts(tok: Any, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = rng.sample(range(5, 60), n)
    return [[rng.randrange(0, len(tok) - 2) for _ in range(k)] for k in lengths]


def _long(tok: Any, max_tokens: int, **more: Any) -> GenerationParams:
    """Greedy, never ending before ``max_tokens`` (EOS banned), so a row surely outlives the test's events."""
    ban = dict.fromkeys(tok.eos_token_ids, -1e9)
    return GenerationParams(max_tokens=max_tokens, logit_bias=ban, **more)


def _engine(model: Any, tok: Any, **options: Any) -> Engine:
    return Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0, **options)


async def _settled(engine: Engine) -> dict[str, Any]:
    """The stats once the last batch turn's report reached the gateway (it may trail the last DoneEvent)."""
    for _ in range(400):
        stats = await engine.stats()
        token = stats["gateway"]["token"]
        if token["holder"] is None and not token["batch_busy"]:
            return stats
        await anyio.sleep(0.005)
    raise AssertionError("the batch lane did not settle within 2 s")


async def test_one_engine_turn_runs_many_batch_steps_when_no_row_joins(
    model: Any, tok: Any, log: StepLog
) -> None:
    """A lone row's 40 tokens take far fewer batch grants than steps; the stats agree on the steps."""
    prompt = _prompts(tok, 1)[0]
    async with _engine(model, tok, max_batch=4, max_burst=16) as eng:
        ids, done = await collect(eng, prompt, GenerationParams(max_tokens=40))
        stats = await _settled(eng)
    assert len(ids) == 40
    assert done.finish_reason == "length"
    token = stats["gateway"]["token"]
    steps = stats["batch"]["batch"]["steps"]["run"]
    assert steps == len(log.steps) == token["batch_chains"]["steps"]
    assert token["batch_lane"]["turns"] <= 5 < steps
    assert token["batch_chains"]["longest"] == 16


async def test_rows_joining_mid_chain_join_within_one_step_and_keep_their_serial_tokens(
    model: Any, tok: Any, log: StepLog
) -> None:
    """Rows admitted while a chain runs join by the second step after their admission; every row's
    greedy tokens equal its serial-lane run."""
    prompts = _prompts(tok, 4, seed=5)
    params = [_long(tok, n) for n in (60, 20, 25, 12)]
    async with _engine(model, tok, max_batch=1) as serial:
        expected = [await collect(serial, p, q) for p, q in zip(prompts, params, strict=True)]
    got: dict[int, Any] = {}
    admitted_by: dict[str, int] = {}
    async with _engine(model, tok, max_batch=4, max_burst=64) as eng:

        async def first() -> None:
            tokens: list[int] = []
            done = None
            async with eng.generate(prompts[0], params[0]) as stream:
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        tokens.append(event.token_id)
                        if len(tokens) in (5, 15, 25):
                            tg.start_soon(later, len(tokens) // 10 + 1)
                    else:
                        done = event
            got[0] = (tokens, done)

        async def later(i: int) -> None:
            tokens: list[int] = []
            done = None
            async with eng.generate(prompts[i], params[i], request_id=f"late-{i}") as stream:
                # NOTE: the stream is open once the scheduler admitted the row
                # (no prompt cache: ready to join at once); steps started so far:
                admitted_by[f"late-{i}"] = log.started
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        tokens.append(event.token_id)
                    else:
                        done = event
            got[i] = (tokens, done)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
        stats = await _settled(eng)
    for i in range(4):
        ids, done = got[i]
        assert ids == expected[i][0], i
        assert done.finish_reason == expected[i][1].finish_reason
    for rid, started in admitted_by.items():
        # NOTE: the step in flight ends, its chain stops, the next job joins the row.
        assert log.index_of_join(rid) <= started + 2, (rid, started, log.index_of_join(rid))
    token = stats["gateway"]["token"]
    assert token["batch_lane"]["turns"] < len(log.steps)


async def test_rows_joining_and_leaving_mid_chain_keep_its_turn(
    model: Any, tok: Any, log: StepLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows admitted while a chain runs (and leaving before it ends) join it without ending the
    turn: the whole run is ONE gateway grant, and the joins are taken by the running chain's later
    steps, not by new engine jobs (at most one more, should the chain run ``AHEAD`` of the loop)."""
    prompts = _prompts(tok, 4, seed=7)
    jobs: list[int] = []

    def counted(chain: Any, *args: Any) -> None:
        jobs.append(chain.turn)
        run_chain(chain, *args)

    monkeypatch.setattr(actor_module, "run_chain", counted)
    async with _engine(model, tok, max_batch=4, max_burst=64) as eng:

        async def first() -> None:
            n = 0
            async with eng.generate(prompts[0], _long(tok, 40)) as stream:
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        n += 1
                        if n in (5, 12, 20):
                            tg.start_soon(later, n // 8 + 1)

        async def later(i: int) -> None:
            await collect(eng, prompts[i], _long(tok, 6))

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
        stats = await _settled(eng)
    joined_at = [i for i, s in enumerate(log.steps, 1) if s.joins]
    assert len(joined_at) >= 3, joined_at
    assert joined_at[-1] > 1, joined_at
    token = stats["gateway"]["token"]
    assert token["batch_chains"]["steps"] == len(log.steps) < 64
    assert token["batch_lane"]["turns"] == 1, token
    assert len(jobs) <= 2, jobs


async def test_a_cancel_mid_chain_removes_its_row_within_one_step(
    model: Any, tok: Any, log: StepLog
) -> None:
    """A row whose reader leaves mid-chain is removed by the second step after the cancel at most;
    the other row goes on to its full length."""
    prompts = _prompts(tok, 2, seed=9)
    params = _long(tok, 80)
    cancelled_by: list[int] = []
    async with _engine(model, tok, max_batch=4, max_burst=64) as eng:
        stayed: list[Any] = []

        async def leaver() -> None:
            n = 0
            async with eng.generate(prompts[0], params, request_id="leaver") as stream:
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        n += 1
                        if n == 10:
                            break
            cancelled_by.append(log.started)

        async def stayer() -> None:
            stayed.append(await collect(eng, prompts[1], params))

        async with anyio.create_task_group() as tg:
            tg.start_soon(leaver)
            tg.start_soon(stayer)
        stats = await _settled(eng)
    (started,) = cancelled_by
    assert log.index_of_cancel("leaver") <= started + 2
    # NOTE: no step after its removal gave the leaver a token.
    removed = log.index_of_cancel("leaver")
    assert all("leaver" not in s.tokens for s in log.steps[removed - 1 :])
    ((ids, done),) = stayed
    assert len(ids) == 80
    assert done.finish_reason == "length"
    assert stats["batch"]["batch"]["requests"]["cancelled"] == 1


async def test_the_serial_lane_gets_turns_while_a_chain_runs(
    model: Any, tok: Any, log: StepLog
) -> None:
    """A prompt-scoring request (serial lane) arriving mid-chain preempts it and finishes long
    before the batch row, with its serial-only tokens."""
    prompts = _prompts(tok, 2, seed=11)
    batch_params = _long(tok, 150)
    serial_params = GenerationParams(max_tokens=10, prompt_logprobs=1)
    async with _engine(model, tok, max_batch=1) as alone:
        want, _ = await collect(alone, prompts[1], serial_params)
    finished: list[str] = []
    async with _engine(model, tok, max_batch=4, max_burst=64) as eng:
        got: list[list[int]] = []

        async def batch_row() -> None:
            n = 0
            async with eng.generate(prompts[0], batch_params) as stream:
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        n += 1
                        if n == 5:
                            tg.start_soon(serial_request)
            finished.append("batch")

        async def serial_request() -> None:
            ids, _ = await collect(eng, prompts[1], serial_params)
            got.append(ids)
            finished.append("serial")

        async with anyio.create_task_group() as tg:
            tg.start_soon(batch_row)
        stats = await _settled(eng)
    assert got == [want]
    assert finished == ["serial", "batch"]
    token = stats["gateway"]["token"]
    assert token["batch_chains"]["preempted"] >= 1
    assert token["batch_refused"] == {"prompt_logprobs": 1}


async def _background_while_rows_chain(
    eng: Engine, tok: Any, log: StepLog, *, seed: int, max_tokens: int, at_token: int
) -> tuple[list[int], dict[str, Any]]:
    """Two long rows; a background step asked for at row 0's ``at_token``-th token.

    Returns the batch steps run when the step ran (one entry per run) and
    the settled stats.
    """
    prompts = _prompts(tok, 2, seed=seed)
    params = _long(tok, max_tokens)
    seen: list[int] = []

    async def row(i: int) -> None:
        n = 0
        async with eng.generate(prompts[i], params) as stream:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    n += 1
                    if i == 0 and n == at_token:
                        tg.start_soon(background)

    async def background() -> None:
        await eng.run_when_idle(lambda: seen.append(len(log.steps)), timeout=30)

    async with anyio.create_task_group() as tg:
        tg.start_soon(row, 0)
        tg.start_soon(row, 1)
    return seen, await _settled(eng)


async def test_background_work_gets_its_share_between_the_steps_of_active_rows(
    model: Any, tok: Any, log: StepLog
) -> None:
    """A background step asked for while rows chain runs between two batch steps, before the rows end.

    NOTE: the background share under load (docs/durability.md): write-behind
    must progress while the server is busy, so it no longer waits for the
    last batch step; it runs at a step boundary, never inside a step.
    """
    async with _engine(model, tok, max_batch=4, max_burst=8) as eng:
        seen, stats = await _background_while_rows_chain(eng, tok, log, seed=13, max_tokens=40,
                                                         at_token=3)
    assert len(seen) == 1
    assert 0 < seen[0] < len(log.steps)
    assert stats["batch"]["batch"]["steps"]["run"] == len(log.steps)


async def test_a_background_step_due_under_load_runs_inside_the_chain_without_cutting_it(
    model: Any, tok: Any, log: StepLog
) -> None:
    """Asked for while rows chain, a background step rides the next chain (lent, once the chain that ended earned its share): it runs between two steps, before the rows end, and no chain is cut for it."""
    async with _engine(model, tok, max_batch=4, max_burst=8, background_in_chain=True) as eng:
        seen, stats = await _background_while_rows_chain(eng, tok, log, seed=17, max_tokens=60,
                                                         at_token=5)
    token = stats["gateway"]["token"]
    assert len(seen) == 1
    assert 0 < seen[0] < len(log.steps)
    assert token["background_under_load"]["in_chain"] == 1
    assert token["grants"]["background"] == 1
    assert token["batch_chains"]["preempted"] == 0
    # NOTE: every chain ran its 8 steps but the last (nothing cut one short).
    assert token["batch_chains"]["steps"] == len(log.steps)
    assert token["batch_chains"]["granted"] == -(-len(log.steps) // 8)
