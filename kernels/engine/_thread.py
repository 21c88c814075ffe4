"""The ONE engine thread that runs every MLX call of a kvtier process.

MLX streams (and MLX's random state) are per thread since mlx 0.31, so all
forward passes, cache clones/trims and tensor read-backs run on a single
dedicated daemon thread. The event loop submits a callable with
``await engine.run(fn, *args)`` and awaits its result without blocking.

Error contract (decided here, documented in ``docs/engine-thread.md``): an
``Exception`` raised by a job is re-raised in the awaiting task as the SAME
exception object (original type, engine-thread traceback attached), so typed
kernel errors cross the thread unchanged. A ``BaseException`` that is not an
``Exception`` (``SystemExit``, ``KeyboardInterrupt``) kills the thread: the
job's waiter and every later submission get ``EngineThreadDead``.

Cancellation contract: cancelling the awaiting task never interrupts the
thread. A job cancelled before it started is skipped; a job cancelled while
running finishes and its result (or error) is discarded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Generic, Literal, ParamSpec, Self, TypeVar

import anyio.to_thread

from kernels._errors import EngineClosed, EngineQueueFull, EngineThreadDead, NotOnEngineThread

__all__ = [
    "EngineStats",
    "EngineThread",
    "on_engine_thread",
    "require_engine_thread",
]

P = ParamSpec("P")
T = TypeVar("T")

_JobState = Literal["queued", "running", "cancelled", "done"]

# NOTE: a thread-local flag rather than a thread id comparison, so kernel code
# can assert "I am on AN engine thread" without a reference to the instance.
_local = threading.local()


def on_engine_thread() -> bool:
    """True when the calling thread is a kvtier engine thread."""
    return bool(getattr(_local, "engine", False))


def require_engine_thread(what: str) -> None:
    """Raise ``NotOnEngineThread`` unless called on an engine thread.

    ``what`` names the operation for the error message (e.g. ``"cache clone"``).
    """
    if not on_engine_thread():
        raise NotOnEngineThread(
            f"{what} must run on the engine thread, not on {threading.current_thread().name!r}"
        )


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine thread's counters.

    ``busy_s`` sums the wall time spent inside jobs; ``queue_depth`` counts
    submitted jobs not yet finished or skipped (the running one included).
    """

    jobs_run: int
    jobs_failed: int
    jobs_skipped: int
    busy_s: float
    queue_depth: int
    max_queue: int
    running: bool
    alive: bool


class _Job(Generic[T]):
    """One submitted callable plus how its outcome reaches the waiter."""

    __slots__ = ("args", "deliver", "fn", "state")

    def __init__(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        deliver: Callable[[T | None, BaseException | None], None],
    ) -> None:
        self.fn = fn
        self.args = args
        self.deliver = deliver
        self.state: _JobState = "queued"


_STOP: Final = object()


def _settle_mlx() -> None:
    """Wait for work this thread queued with ``mx.async_eval`` and never read.

    NOTE: decode steps pipeline the next forward (``mx.async_eval``); a
    generation that ends leaves that forward in flight on this thread's
    stream. A thread that exits with such work pending made the process hang
    or abort ("terminate called without an active exception") at exit, with
    OpenBLAS preloaded (2 of 3 runs of a minimal script); synchronizing first
    made every run exit cleanly.
    """
    try:
        import mlx.core as mx

        mx.synchronize()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


class EngineThread:
    """A dedicated daemon thread that runs submitted callables one at a time, FIFO.

    ``max_queue`` bounds the jobs submitted but not yet finished; one more
    raises ``EngineQueueFull`` immediately (the gateway hands out one turn at
    a time, so a full queue signals a bug upstream, never normal load).
    Use as a (sync or async) context manager, or call ``close()``/``aclose()``.
    """

    def __init__(self, *, name: str = "kvtier-engine", max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._max_queue = max_queue
        self._queue: queue.SimpleQueue[_Job[Any] | object] = queue.SimpleQueue()
        # NOTE: one lock guards job state transitions and the counters, so a
        # cancel and the worker's "start" can never both win for one job.
        self._lock = threading.Lock()
        self._pending = 0
        self._jobs_run = 0
        self._jobs_failed = 0
        self._jobs_skipped = 0
        self._busy_s = 0.0
        self._running = False
        self._closed = False
        self._dead = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    # -- submission ---------------------------------------------------------

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(*args)`` on the engine thread and return its result.

        Awaits without blocking the event loop (asyncio backend). A job's
        exception is re-raised here unchanged. Cancelling the awaiting task
        skips the job if it has not started, otherwise its result is dropped.
        Keyword arguments are not accepted (bind them with ``functools.partial``).
        """
        if kwargs:
            raise TypeError("EngineThread.run takes positional arguments only")
        future, job = self._submit_async(fn, args)
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(job)
            raise

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[T]:
        """Queue ``fn(*args)`` now (from the event loop) and return a future of its outcome.

        Lets a caller overlap its own work with the job (e.g. stream a token
        while the next decode step runs). Errors as in :meth:`run`. NOTE:
        cancelling the returned future never skips or interrupts the job;
        await it to know the engine thread is done with the job's inputs.
        """
        if kwargs:
            raise TypeError("EngineThread.submit takes positional arguments only")
        future, _ = self._submit_async(fn, args)
        return future

    def _submit_async(self, fn: Callable[..., T], args: tuple[Any, ...]) -> tuple[asyncio.Future[T], _Job[T]]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            # NOTE: runs on the loop; the waiter may have been cancelled meanwhile.
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        def deliver(result: T | None, error: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:
                # NOTE: the loop is closed; nobody is left to receive the outcome.
                pass

        job = self._submit(fn, args, deliver)
        return future, job

    def sync_run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Blocking variant of :meth:`run` for tests, tools and non-async callers.

        Called on the engine thread itself it runs ``fn`` inline (a nested
        submission would deadlock). Never call it from the event loop thread.
        """
        if kwargs:
            raise TypeError("EngineThread.sync_run takes positional arguments only")
        if self.is_engine_thread():
            return fn(*args, **kwargs)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def deliver(result: T | None, error: BaseException | None) -> None:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        self._submit(fn, args, deliver)
        return future.result()

    def _submit(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        deliver: Callable[[T | None, BaseException | None], None],
    ) -> _Job[T]:
        job = _Job(fn, args, deliver)
        with self._lock:
            if self._dead:
                raise EngineThreadDead("the engine thread has exited abnormally")
            if self._closed:
                raise EngineClosed("the engine thread is closed")
            if self._pending >= self._max_queue:
                raise EngineQueueFull(f"{self._pending} engine jobs pending (max {self._max_queue})")
            self._pending += 1
        self._queue.put(job)
        return job

    def _cancel(self, job: _Job[Any]) -> None:
        with self._lock:
            if job.state == "queued":
                job.state = "cancelled"

    # -- the thread ---------------------------------------------------------

    def _main(self) -> None:
        _local.engine = True
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                assert isinstance(item, _Job)
                if not self._run_one(item):
                    return
        finally:
            _settle_mlx()

    def _run_one(self, job: _Job[Any]) -> bool:
        """Run one job; False when the thread must die."""
        with self._lock:
            if job.state == "cancelled":
                self._jobs_skipped += 1
                self._pending -= 1
                return True
            job.state = "running"
            self._running = True
        started = time.perf_counter()
        result: Any = None
        error: BaseException | None = None
        fatal = False
        try:
            result = job.fn(*job.args)
        except Exception as exc:  # noqa: BLE001 - any job error goes back to its waiter
            error = exc
        except BaseException as exc:  # noqa: BLE001 - see NOTE
            # NOTE: SystemExit/KeyboardInterrupt inside a job: the thread stops,
            # the waiter learns why, later submissions fail fast.
            error = EngineThreadDead(f"engine thread stopped by {type(exc).__name__}")
            error.__cause__ = exc
            fatal = True
        elapsed = time.perf_counter() - started
        with self._lock:
            job.state = "done"
            self._running = False
            self._busy_s += elapsed
            self._pending -= 1
            if error is None:
                self._jobs_run += 1
            else:
                self._jobs_failed += 1
            if fatal:
                self._dead = True
        job.deliver(result, error)
        if fatal:
            self._fail_queued()
        return not fatal

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Job):
                with self._lock:
                    self._pending -= 1
                    skipped = item.state == "cancelled"
                    if skipped:
                        self._jobs_skipped += 1
                if not skipped:
                    item.deliver(None, EngineThreadDead("the engine thread has exited abnormally"))

    # -- introspection ------------------------------------------------------

    def is_engine_thread(self) -> bool:
        """True when called on THIS engine thread."""
        return threading.current_thread() is self._thread

    @property
    def thread_ident(self) -> int | None:
        """The engine thread's ``threading.get_ident()`` value."""
        return self._thread.ident

    def statistics(self) -> EngineStats:
        """Counters: jobs run/failed/skipped, busy time, queue depth."""
        with self._lock:
            return EngineStats(
                jobs_run=self._jobs_run,
                jobs_failed=self._jobs_failed,
                jobs_skipped=self._jobs_skipped,
                busy_s=self._busy_s,
                queue_depth=self._pending,
                max_queue=self._max_queue,
                running=self._running,
                alive=self._thread.is_alive(),
            )

    # -- shutdown -----------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting jobs, let queued ones finish, join the thread (blocking).

        Idempotent. From async code use :meth:`aclose` instead.
        """
        with self._lock:
            first = not self._closed
            self._closed = True
        if first:
            self._queue.put(_STOP)
        if not self.is_engine_thread():
            self._thread.join(timeout)

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop."""
        await anyio.to_thread.run_sync(self.close)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (or the thread died)."""
        with self._lock:
            return self._closed or self._dead

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
