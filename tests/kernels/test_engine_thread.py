"""The engine thread: results, typed errors, cancellation, loop liveness, shutdown."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import mlx.core as mx
import pytest

from kernels import (
    EngineQueueFull,
    EngineThread,
    EngineThreadClosed,
    EngineThreadDead,
    NotOnEngineThread,
    on_engine_thread,
    require_engine_thread,
)

pytestmark = pytest.mark.anyio

_REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def engine() -> Iterator[EngineThread]:
    """A fresh engine thread, closed after the test."""
    with EngineThread(name="test-engine") as eng:
        yield eng


class JobFailed(Exception):
    """A typed error raised inside a job."""

    def __init__(self, code: int) -> None:
        super().__init__(f"job failed with {code}")
        self.code = code


async def _wait_for(event: threading.Event) -> None:
    """Wait for a thread-side event without blocking the loop."""
    assert await anyio.to_thread.run_sync(event.wait, 5), "the engine job never started"


def _blocking_job(started: threading.Event, release: threading.Event, ran: list[str], tag: str) -> str:
    started.set()
    assert release.wait(5), "test never released the job"
    ran.append(tag)
    return tag


async def test_mlx_job_runs_on_engine_thread_and_returns_result(engine: EngineThread) -> None:
    """A job's MLX computation runs on the engine thread and its value comes back."""

    def job(n: int) -> tuple[int, float, bool]:
        value = mx.sum(mx.arange(n, dtype=mx.float32))
        mx.eval(value)
        return threading.get_ident(), value.item(), on_engine_thread()  # type: ignore[return-value]

    ident, total, flagged = await engine.run(job, 10)
    assert ident == engine.thread_ident
    assert ident != threading.get_ident()
    assert total == 45.0
    assert flagged is True
    assert not on_engine_thread()
    stats = engine.statistics()
    assert stats.jobs_run == 1
    assert stats.queue_depth == 0
    assert stats.busy_s > 0


async def test_job_error_comes_back_with_its_original_type(engine: EngineThread) -> None:
    """An exception raised in a job is re-raised in the awaiting task unchanged."""

    def failing() -> None:
        raise JobFailed(7)

    with pytest.raises(JobFailed) as info:
        await engine.run(failing)
    assert info.value.code == 7
    assert await engine.run(lambda: "still alive") == "still alive"
    stats = engine.statistics()
    assert (stats.jobs_failed, stats.jobs_run) == (1, 1)


async def test_submit_queues_at_once_and_its_future_carries_the_outcome(engine: EngineThread) -> None:
    """``submit`` starts the job before anyone awaits it; the future yields its value, or its error unchanged."""
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []
    future = engine.submit(_blocking_job, started, release, ran, "a")
    # NOTE: nothing awaited the future yet, and the job is already running.
    await _wait_for(started)
    assert not future.done()
    release.set()
    assert await future == "a"

    def failing() -> None:
        raise JobFailed(3)

    with pytest.raises(JobFailed) as info:
        await engine.submit(failing)
    assert info.value.code == 3
    assert ran == ["a"]


async def test_job_cancelled_before_start_is_skipped(engine: EngineThread) -> None:
    """A job whose waiter is cancelled while it is still queued never runs."""
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run, _blocking_job, started, release, ran, "first")
        await _wait_for(started)
        with anyio.move_on_after(0.05) as scope:
            await engine.run(ran.append, "second")
        assert scope.cancelled_caught
        release.set()
    assert await engine.run(lambda: "third") == "third"
    assert ran == ["first"]
    stats = engine.statistics()
    assert stats.jobs_skipped == 1
    assert stats.queue_depth == 0


async def test_job_cancelled_while_running_finishes_and_thread_stays_healthy(
    engine: EngineThread,
) -> None:
    """Cancelling the waiter of a running job discards its result; the next job works."""
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []
    with anyio.move_on_after(5) as outer:
        async with anyio.create_task_group() as tg:

            async def waiter() -> None:
                with anyio.CancelScope() as scope:
                    tg.start_soon(_cancel_when_started, scope, started)
                    await engine.run(_blocking_job, started, release, ran, "long")
                    pytest.fail("the result of a cancelled job must not be delivered")

            tg.start_soon(waiter)
    assert not outer.cancelled_caught
    release.set()
    assert await engine.run(lambda: 41 + 1) == 42
    assert ran == ["long"]
    stats = engine.statistics()
    assert stats.jobs_run == 2
    assert stats.jobs_skipped == 0


async def _cancel_when_started(scope: anyio.CancelScope, started: threading.Event) -> None:
    await _wait_for(started)
    scope.cancel()


async def test_event_loop_keeps_running_during_a_long_job(engine: EngineThread) -> None:
    """A 500 ms job on the engine thread does not block a concurrent ticking task."""
    ticks = 0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await engine.run(time.sleep, 0.5)
        done.set()
    # NOTE: a blocked loop would tick once; 10 ms ticks over 500 ms give ~50.
    assert ticks >= 10


async def test_full_queue_raises_typed_error() -> None:
    """With max_queue=1 and one job pending, another submission raises EngineQueueFull."""
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []
    with EngineThread(max_queue=1) as eng:
        async with anyio.create_task_group() as tg:
            tg.start_soon(eng.run, _blocking_job, started, release, ran, "only")
            await _wait_for(started)
            with pytest.raises(EngineQueueFull):
                await eng.run(ran.append, "overflow")
            release.set()
        assert await eng.run(lambda: "after") == "after"
    assert ran == ["only"]


async def test_close_drains_queued_jobs_then_rejects_new_ones() -> None:
    """close() lets queued jobs finish before it returns, and later submissions fail typed."""
    ran: list[int] = []
    eng = EngineThread()
    for i in range(3):
        eng.sync_run(ran.append, i)
    await eng.aclose()
    assert ran == [0, 1, 2]
    assert not eng.statistics().alive
    assert eng.closed
    with pytest.raises(EngineThreadClosed):
        await eng.run(ran.append, 99)
    with pytest.raises(EngineThreadClosed):
        eng.sync_run(ran.append, 99)


def test_require_engine_thread_and_inline_sync_run(engine: EngineThread) -> None:
    """require_engine_thread fails off the thread, passes on it; nested sync_run runs inline."""
    with pytest.raises(NotOnEngineThread):
        require_engine_thread("cache clone")

    def outer() -> tuple[int, int]:
        require_engine_thread("cache clone")
        inner = engine.sync_run(threading.get_ident)
        return threading.get_ident(), inner

    a, b = engine.sync_run(outer)
    assert a == b == engine.thread_ident
    assert engine.is_engine_thread() is False


async def test_base_exception_kills_thread_with_typed_error() -> None:
    """A SystemExit inside a job kills its EngineThread: its waiter and later callers get EngineThreadDead."""
    eng = EngineThread()

    def exit_job() -> None:
        raise SystemExit(3)

    with pytest.raises(EngineThreadDead) as info:
        await eng.run(exit_job)
    assert isinstance(info.value.__cause__, SystemExit)
    with pytest.raises(EngineThreadDead):
        await eng.run(lambda: None)
    eng.close(timeout=5)
    assert not eng.statistics().alive


async def test_fatal_job_kills_its_instance_only() -> None:
    """After a SystemExit kills one EngineThread, another one still runs jobs on the same OS thread."""
    doomed, other = EngineThread(), EngineThread()
    try:
        started, release = threading.Event(), threading.Event()
        ran: list[str] = []

        def exit_job() -> None:
            raise SystemExit(1)

        async with anyio.create_task_group() as tg:
            # NOTE: the doomed instance has a second job queued behind the fatal one.
            tg.start_soon(doomed.run, _blocking_job, started, release, ran, "first")
            await _wait_for(started)
            fatal = doomed.submit(exit_job)
            queued = doomed.submit(ran.append, "never")
            release.set()
        with pytest.raises(EngineThreadDead):
            await fatal
        with pytest.raises(EngineThreadDead):
            await queued
        assert await other.run(threading.get_ident) == doomed.thread_ident
        assert ran == ["first"]
        assert other.statistics().alive
        assert not doomed.statistics().alive
    finally:
        doomed.close(timeout=5)
        other.close(timeout=5)


def _job_thread(eng: EngineThread) -> threading.Thread:
    return eng.sync_run(threading.current_thread)


def test_close_parks_the_os_thread_and_the_next_engine_thread_reuses_it() -> None:
    """Closing an EngineThread never ends its OS thread; a later EngineThread runs on that same thread."""
    with EngineThread(name="first") as first:
        thread = _job_thread(first)
    assert first.closed
    assert not first.statistics().alive
    assert thread.is_alive(), "close() ended the engine OS thread"
    with EngineThread(name="second") as second:
        assert _job_thread(second) is thread
        assert thread.name == "second"


# NOTE: a child process that closes an EngineThread whose job used an
# mx.compile'd function (MLX keeps a per-thread compile cache that holds
# Python objects) and then finalizes the interpreter. The job also registers
# a C thread-exit destructor that sleeps 200 ms (glibc runs thread-exit
# destructors last-registered first), so an engine thread that ends on close
# reaches MLX's destructor, which takes the GIL, only once the main thread is
# finalizing: that aborts ("terminate called without an active exception",
# SIGABRT) every time, where a race decides it without the sleep. A slow
# __del__ keeps finalization going past that point.
_EXIT_CHILD = """
import ctypes, sys, time
import mlx.core as mx
from kernels import EngineThread

@mx.compile
def double_plus_one(x):
    return x * 2 + 1

libc = ctypes.CDLL(None)
at_thread_exit = libc.__cxa_thread_atexit_impl
at_thread_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
usleep = ctypes.cast(libc.usleep, ctypes.c_void_p).value

def job():
    mx.eval(double_plus_one(mx.ones((4,))))
    at_thread_exit(usleep, 200_000, None)

class SlowFinalizer:
    def __del__(self):
        time.sleep(1.0)

slow = SlowFinalizer()
with EngineThread() as eng:
    eng.sync_run(job)
print("closed", flush=True)
"""


def test_process_exits_cleanly_when_finalization_overlaps_engine_thread_teardown(tmp_path: Path) -> None:
    """A process whose EngineThread used compiled MLX code exits 0 even when interpreter finalization races the thread's end."""
    if not _glibc_thread_atexit():
        pytest.skip("needs glibc's __cxa_thread_atexit_impl")
    script = tmp_path / "exit_child.py"
    script.write_text(_EXIT_CHILD)
    env = dict(os.environ, PYTHONPATH=str(_REPO))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=_REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout == "closed\n"
    assert proc.returncode == 0, f"exit status {proc.returncode}; stderr tail:\n{proc.stderr[-2000:]}"


def _glibc_thread_atexit() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "__cxa_thread_atexit_impl")
    except OSError:
        return False
