"""The ONE engine thread that runs every MLX call of a kvtier process.

MLX streams (and MLX's random state) are per thread since mlx 0.31, so all
forward passes, cache clones/trims and tensor read-backs run on a single
dedicated daemon thread. The event loop submits a callable with
``await engine.run(fn, *args)`` and awaits its result without blocking.

Lifetime contract: the OS thread is started by the first ``EngineThread`` of
the process and is never ended; every later ``EngineThread`` (every
``Engine``) runs its jobs on it. Closing an ``EngineThread`` waits until its
own jobs are done and parks the thread. NOTE: an OS thread that ends runs its
C++ thread-local destructors after Python's ``join()`` has returned; MLX's
per-thread compile cache holds Python objects, so its destructor takes the
GIL, and if the main thread is finalizing the interpreter by then, taking the
GIL ends the thread with ``pthread_exit`` inside that destructor, which
aborts the process ("terminate called without an active exception"). A
thread that never ends never runs those destructors (docs/engine-thread.md).

Error contract (decided here, documented in ``docs/engine-thread.md``): an
``Exception`` raised by a job is re-raised in the awaiting task as the SAME
exception object (original type, engine-thread traceback attached), so typed
kernel errors cross the thread unchanged. A ``BaseException`` that is not an
``Exception`` (``SystemExit``, ``KeyboardInterrupt``) kills the
``EngineThread``: the job's waiter and every later submission get
``EngineThreadDead`` (the OS thread itself goes on serving other instances).

Cancellation contract: cancelling the awaiting task never interrupts the
thread. A job cancelled before it started is skipped; a job cancelled while
running finishes and its result (or error) is discarded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Generic, Literal, ParamSpec, Self, TypeVar

import anyio.to_thread

from kernels._errors import EngineQueueFull, EngineThreadClosed, EngineThreadDead, NotOnEngineThread

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


_THREAD_NAME: Final = "kvtier-engine"


class _ParkedThread:
    """The process's one engine OS thread: started on first use, parked between tasks, never ended.

    Tasks are zero-argument callables queued by ``EngineThread`` instances,
    run FIFO; each one is written so that it never raises (a job's errors go
    to its waiter), so the loop below never ends.
    """

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=_THREAD_NAME, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        _local.engine = True
        while True:
            self.tasks.get()()


_parked: _ParkedThread | None = None
_parked_lock = threading.Lock()


def _engine_os_thread() -> _ParkedThread:
    """The parked engine thread, started on the first call in this process."""
    global _parked
    with _parked_lock:
        if _parked is None:
            _parked = _ParkedThread()
        return _parked


def _forget_parked_thread() -> None:
    """In a forked child: the parent's engine thread does not exist here."""
    global _parked, _parked_lock
    _parked = None
    _parked_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parked_thread)


def _settle_mlx() -> BaseException | None:
    """Wait for work this thread queued with ``mx.async_eval`` and never read; return its error.

    NOTE: decode steps pipeline the next forward (``mx.async_eval``); a
    generation that ends leaves that forward in flight on the engine thread's
    stream. Closing an ``EngineThread`` waits for it, so an engine that closed
    has nothing running and its arrays can be freed.
    """
    import mlx.core as mx

    try:
        mx.synchronize()
    except Exception as exc:  # noqa: BLE001 - handed to close(), which re-raises it
        return exc
    return None


class EngineThread:
    """A handle on the process's engine thread that runs submitted callables one at a time, FIFO.

    Every instance submits to the same OS thread (see the module docstring):
    jobs of two open instances interleave in submission order. Each instance
    has its own bound, counters and lifetime. ``max_queue`` bounds the jobs
    submitted but not yet finished; one more raises ``EngineQueueFull``
    immediately (the gateway hands out one turn at a time, so a full queue
    signals a bug upstream, never normal load). ``name`` is the thread's name
    while it runs this instance's jobs. Use as a (sync or async) context
    manager, or call ``close()``/``aclose()``.
    """

    def __init__(self, *, name: str = _THREAD_NAME, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._name = name
        self._max_queue = max_queue
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
        # NOTE: set on the engine thread once every job queued before close()
        # is done and MLX's in-flight work has settled: what close() waits for,
        # in place of joining a thread that must never end.
        self._finished = threading.Event()
        self._settle_error: BaseException | None = None
        self._os = _engine_os_thread()
        self._thread = self._os.thread

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
                raise EngineThreadClosed("the engine thread is closed")
            if self._pending >= self._max_queue:
                raise EngineQueueFull(f"{self._pending} engine jobs pending (max {self._max_queue})")
            self._pending += 1
            # NOTE: queued under the lock, so a job accepted before close()
            # always runs before that close's final task.
            self._os.tasks.put(lambda: self._run_one(job))
        return job

    def _cancel(self, job: _Job[Any]) -> None:
        with self._lock:
            if job.state == "queued":
                job.state = "cancelled"

    # -- on the engine thread -----------------------------------------------

    def _run_one(self, job: _Job[Any]) -> None:
        """Run one job of this instance; never raises (the parked thread must not end)."""
        with self._lock:
            if job.state == "cancelled":
                self._jobs_skipped += 1
                self._pending -= 1
                return
            if self._dead:
                # NOTE: queued before a fatal job of this instance; fail it typed.
                self._pending -= 1
                dead = True
            else:
                job.state = "running"
                self._running = True
                dead = False
        if dead:
            job.deliver(None, EngineThreadDead("the engine thread has exited abnormally"))
            return
        thread = threading.current_thread()
        if thread.name != self._name:
            thread.name = self._name
        started = time.perf_counter()
        result: Any = None
        error: BaseException | None = None
        fatal = False
        try:
            result = job.fn(*job.args)
        except Exception as exc:  # noqa: BLE001 - any job error goes back to its waiter
            error = exc
        except BaseException as exc:  # noqa: BLE001 - see NOTE
            # NOTE: SystemExit/KeyboardInterrupt inside a job: this instance
            # stops, the waiter learns why, later submissions fail fast. The
            # OS thread stays parked for other instances (module docstring).
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

    def _finish(self) -> None:
        """The last task of this instance: collect, settle MLX, then release close()."""
        # NOTE: the engine thread outlives every instance, and the owner of
        # the jobs may leave its arrays in reference cycles (a closed
        # Engine's stopped actors still reach its model and cached KV). A
        # collection here frees them now and on this thread; while an
        # Engine's own release job ran, the loop could still hold a part of
        # such a cycle for a moment, and the arrays then waited for a later
        # collection on any thread (measured: kept alive after 8 of 18 closes).
        gc.collect()
        self._settle_error = _settle_mlx()
        self._finished.set()

    # -- introspection ------------------------------------------------------

    def is_engine_thread(self) -> bool:
        """True when called on the engine thread."""
        return threading.current_thread() is self._thread

    @property
    def thread_ident(self) -> int | None:
        """The engine thread's ``threading.get_ident()`` value."""
        return self._thread.ident

    def statistics(self) -> EngineStats:
        """Counters: jobs run/failed/skipped, busy time, queue depth.

        ``alive`` is true until this instance is closed (its jobs done) or
        killed by a fatal job; the OS thread itself stays parked.
        """
        with self._lock:
            return EngineStats(
                jobs_run=self._jobs_run,
                jobs_failed=self._jobs_failed,
                jobs_skipped=self._jobs_skipped,
                busy_s=self._busy_s,
                queue_depth=self._pending,
                max_queue=self._max_queue,
                running=self._running,
                alive=not (self._dead or self._finished.is_set()) and self._thread.is_alive(),
            )

    # -- shutdown -----------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting jobs, let queued ones finish, wait until they are done (blocking).

        Idempotent. The OS thread is parked, never ended (module docstring).
        Re-raises an MLX error met while settling in-flight work. From async
        code use :meth:`aclose` instead.
        """
        with self._lock:
            first = not self._closed
            self._closed = True
            if first:
                self._os.tasks.put(self._finish)
        if self.is_engine_thread():
            return
        if self._finished.wait(timeout) and first and self._settle_error is not None:
            raise self._settle_error

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop."""
        await anyio.to_thread.run_sync(self.close)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (or a fatal job killed this instance)."""
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
